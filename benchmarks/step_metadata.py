"""Host time to build one decode step's metadata (``build_forward_batch``), as the engine does
before each step, for a captured graph's bucket (padded to ``max_model_len``) and for an
unpadded eager step: Llama and V4 layouts, B decoding sequences at position ~500, each holding the blocks its tokens fill.

Run: ``python benchmarks/step_metadata.py [--batches 1 64] [--lengths 2048 8192]``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint

META = torch.device("meta")
CPU = torch.device("cpu")


def build_us(
    layout: CacheLayout, batch: int, padding: StepPadding | None, num_blocks: int, repeats: int
) -> float:
    """Microseconds per build (best of ``repeats`` rounds of 20), host tensors only."""
    pools = allocate_pools(layout, num_blocks, batch, torch.float32, META)
    per_seq = (500 + batch) // layout.block_size + 1  # the blocks a sequence at ~500 holds
    chunks = [
        SeqChunk(list(range(i * per_seq, (i + 1) * per_seq)), i, 500 + i, 1, logits_offsets=[0])
        for i in range(batch)
    ]
    build_forward_batch(layout, pools, chunks, CPU, padding)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            build_forward_batch(layout, pools, chunks, CPU, padding)
        best = min(best, (time.perf_counter() - start) / 20)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    print("| code | model | batch | step | host us per build |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "deepseek_v4"):
            model = load_model(make_tiny_checkpoint(Path(tmp) / arch, arch=arch), device=META)
            layout = CacheLayout.from_specs(model.cache_spec(), 16)
            for batch in args.batches:
                blocks = batch * (max(args.lengths) // 16)
                cases = [("eager", None)] + [
                    (f"graph, max_model_len {n}", StepPadding(blocks, batch, batch, n)) for n in args.lengths
                ]
                for name, padding in cases:
                    us = build_us(layout, batch, padding, blocks, args.repeats)
                    print(f"| {args.label} | {arch} | {batch} | {name} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
