"""Compiled vs eager decode step time of a tiny model: the engine's compiled step
(``PrecompiledStep``: the CPU's passes, compiled ahead of time) and ``torch.compile`` with every
fusion pass (the CUDA pipeline), and the first call's compile time, on this machine.

Run: ``python benchmarks/compile_vs_eager.py [--batches 1 8 64] [--arch deepseek_v4]``.
Steps are padded as the engine pads them (``StepPadding``), so one graph serves every batch
size: "first call" is the compile, paid once. ``deepinfer bench startup --compile on`` measures
the warm start of a fresh process. Prints a markdown table for RESULTS.md."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.compile.compilation import compile_step
from deepinfer.compile.precompiled import PrecompiledStep
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint


def decode_inputs(model, batch: int, position: int, padded: bool):
    """One decode token per sequence at ``position`` (its earlier rows: zeroed cache)."""
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    blocks = layout.block_size and -(-(position + 1) // layout.block_size)
    pools = allocate_pools(layout, batch * blocks, batch, model.compute_dtype, torch.device("cpu"))
    chunks = [
        SeqChunk(list(range(i * blocks, (i + 1) * blocks)), i, position, 1, logits_offsets=[0])
        for i in range(batch)
    ]
    padding = StepPadding.for_pools(batch * blocks, batch) if padded else None
    positions, fb = build_forward_batch(layout, pools, chunks, torch.device("cpu"), padding)
    return torch.randint(2, model.config.vocab_size, (positions.shape[0],)), positions, fb


def best_time(fn, args, repeats: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deepseek_v4")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", arch=args.arch, seed=0)
    model = load_model(path)
    from deepinfer.compile_passes import PASSES

    variants = {
        # what the engine runs with compile=True on the CPU: the platform's passes (verification
        # only), compiled ahead of time, guards checked by PrecompiledStep
        "default passes": PrecompiledStep(model, Path(tempfile.mkdtemp())),
        "all passes": compile_step(model, passes=PASSES),  # the CUDA pipeline, torch.compile
    }
    print(
        "| batch | eager step (ms) | engine's compiled step (ms) | torch.compile, all passes (ms) "
        "| speedup (engine's) |"
    )
    print("|---:|---:|---:|---:|---:|")
    first: dict[str, float] = {}
    with torch.inference_mode():
        for batch in args.batches:
            eager_in = decode_inputs(model, batch, args.position, padded=False)
            padded_in = decode_inputs(model, batch, args.position, padded=True)
            times = {}
            for name, fn in variants.items():
                if name not in first:
                    start = time.perf_counter()
                    fn(*padded_in)
                    first[name] = time.perf_counter() - start
                times[name] = best_time(fn, padded_in, args.repeats)
            eager = best_time(model.step, eager_in, args.repeats)
            default, every = times["default passes"], times["all passes"]
            print(
                f"| {batch} | {eager * 1e3:.2f} | {default * 1e3:.2f} | {every * 1e3:.2f} | {eager / default:.2f}x |",
                flush=True,
            )
    print(f"first compiled call (compile; one graph serves all batches): {first}")


if __name__ == "__main__":
    main()
