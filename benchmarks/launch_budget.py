"""Kernel launches of one eager decode step on the CUDA code path, per decoder layer, counted
on the CPU (``deepinfer.compile.launch_count``): the tiny V4, V4.1 and Llama configs and the
models of ``benchmarks/gpu_decode.py`` in bf16 (built on the meta device, no checkpoint
written).

"before" counts with the fused ops' CUDA kernels switched off (``--unfused``: what CUDA ran
before them, their plain PyTorch), "after" with them on. Prints a markdown table; ``--ops``
adds each config's most frequent launches per layer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from deepinfer.compile.launch_count import (
    LaunchCount,
    count_decode_launches,
    kernels_disabled,
    meta_model,
    meta_model_from_config,
)
from deepinfer.tiny import make_tiny_checkpoint, tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import MODELS  # noqa: E402  (the benchmark's shapes, one definition)

FUSED = tuple(
    f"deepinfer::{op}"
    for op in (
        "sinkhorn",
        "rms_norm",
        "add_rms_norm",
        "paged_decode_attention",
        "rope_store",
        "silu_and_mul",
        "hc_pre",
        "hc_post",
        "moe_gate",
        "interleaved_rope",
        "compress_groups",
        "fake_quant",
    )
)
TINY = ("deepseek_v4", "deepseek_v41", "llama")


def _models(root: Path, big: bool) -> dict[str, object]:
    models = {arch: meta_model(make_tiny_checkpoint(root / arch, arch=arch)) for arch in TINY}
    if big:
        for label, arch, dims in MODELS.values():
            models[f"{label} (gpu_decode, bf16)"] = meta_model_from_config(tiny_config(arch, **dims))
    return models


def _per_layer_ops(count: LaunchCount, top: int) -> str:
    mean = Counter({op: n / len(count.per_layer) for op, n in sum(count.per_layer, Counter()).items()})
    return ", ".join(f"{op} {n:g}" for op, n in mean.most_common(top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="decode tokens in the step (a graph bucket)")
    parser.add_argument(
        "--unfused", nargs="*", default=list(FUSED), help="ops whose CUDA kernels 'before' switches off"
    )
    parser.add_argument("--no-big", action="store_true", help="only the tiny configs")
    parser.add_argument("--ops", type=int, default=0, help="list this many top ops per layer (after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        models = _models(Path(root), not args.no_big)
        print(f"torch {torch.__version__}; before: {', '.join(args.unfused) or 'nothing'} unfused")
        print("| config | layers | launches / layer before | after | total before | after |")
        print("|---|---:|---:|---:|---:|---:|")
        after_counts = {}
        for name, model in models.items():
            with kernels_disabled(args.unfused):
                before = count_decode_launches(model, args.batch)
            after = after_counts[name] = count_decode_launches(model, args.batch)
            print(
                f"| {name} | {len(after.per_layer)} | {before.per_layer_mean:.1f} | {after.per_layer_mean:.1f} "
                f"| {before.total} | {after.total} |",
                flush=True,
            )
        if args.ops:
            print()
            for name, count in after_counts.items():
                layers = ", ".join(str(sum(c.values())) for c in count.per_layer)
                print(f"- {name}: layers {layers}; per layer: {_per_layer_ops(count, args.ops)}")


if __name__ == "__main__":
    main()
