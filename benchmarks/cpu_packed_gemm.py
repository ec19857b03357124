"""fp32 projection kernels on SmolLM2-135M's layer stack: ``cpu_packed_gemm`` against oneDNN's
packed GEMM (the engine's earlier choice above 16 rows; the fp32 GEMV it ran below, since
removed, is in RESULTS.md's history table).

Thirty layers of random weights with SmolLM2's shapes (qkv 960 x 576, o 576 x 576, gate/up
3072 x 576, down 576 x 1536; 425 MB of fp32, far past the caches), one pass of M activation
rows through all of them, as a decode or prefill step runs them; best of five passes.

    python benchmarks/cpu_packed_gemm.py --rows 1 4 8 16 32 64 256 1024 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from deepinfer.kernels.cpu import packed_gemm as cpu_packed_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def best_of(fn: Callable[[], None], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256, 1024])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[cpu_packed_gemm.pack(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer] for layer in weights]
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads"
    )
    print("| rows | cpu_packed_gemm | oneDNN packed | packed / oneDNN |")
    print("|---:|---:|---:|---:|")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
        flop = 2 * m * LAYERS * sum(n * k for n, k in SHAPES)
        t_ours = best_of(lambda xs=xs: run_packed(packed, xs))
        t_theirs = best_of(lambda xs=xs: run_onednn(onednn, xs))
        print(f"| {m} | {cell(t_ours, flop)} | {cell(t_theirs, flop)} | {t_theirs / t_ours:.2f}x |")


def run_packed(packed: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for layer in packed:
        for (n, k), p in zip(SHAPES, layer, strict=True):
            cpu_packed_gemm.gemm(xs[k], p, n)


def run_onednn(onednn: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for layer in onednn:
        for (_, k), p in zip(SHAPES, layer, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")


def cell(t: float, flop: int) -> str:
    return f"{t * 1e3:.2f} ms ({flop / t / 1e9:.0f} GFLOP/s)"


if __name__ == "__main__":
    main()
