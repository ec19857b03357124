"""The int4 x int8 kernel (``kernels/cpu/int4_vnni.py``: AVX-512 VNNI, or AVX2 where VNNI is
missing; the header names which ran) alone: multiply-adds per second on SmolLM2-135M's
projection shapes and its head, at decode and prefill row counts, against PyTorch's own int4
kernel (``_weight_int4pack_mm_for_cpu``, bf16 activations) on the same weights, ``cpu_gemv``'s
fp32 widening loop (what int4 ran at up to 4 rows on CPUs without VNNI before the AVX2 path),
and the machine's fp32 ceiling for comparison (oneDNN's packed fp32 GEMM).

    python benchmarks/int4_vnni_kernel.py [--rows 1 4 8 16 32 512] [--threads 2]

Weights are random int4 values with random bf16 scales and zeros (the kernel's speed does not
depend on them). Each figure is the best of five timed windows of ~50 ms.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from deepinfer.kernels.cpu import gemv as cpu_gemv
from deepinfer.kernels.cpu import int4_vnni as cpu_int4_vnni
from deepinfer.kernels.weight_only import QUANTIZED_SMALL_ROWS, WeightOnlyLinear

# SmolLM2-135M: qkv (576 -> 960), o (576 -> 576), gate/up (576 -> 3072), down (1536 -> 576), head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def best_seconds(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 512])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not cpu_int4_vnni.available():
        raise SystemExit(
            "this CPU has neither AVX-512 VNNI nor AVX2 (or no compiler): the kernel is not built"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; kernel path {cpu_int4_vnni.isa()}; GMAC/s (multiply-adds per second)")
    print(
        "| N | K | rows | int4 x int8 kernel | PyTorch int4 (bf16 activations) | widening loop | oneDNN fp32 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.05
        int4 = WeightOnlyLinear(weight, None, "int4")
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # oneDNN's packed fp32 copy
        assert int4.packed_vnni is not None
        for m in args.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            macs = n * k * m / 1e9
            ours = macs / best_seconds(lambda: cpu_int4_vnni.gemm(x, int4.packed_vnni, n))  # noqa: B023
            torch_int4 = macs / best_seconds(
                lambda: torch._weight_int4pack_mm_for_cpu(xb, int4.qweight, 32, int4.scales)  # noqa: B023
            )
            fp32 = macs / best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")  # noqa: B023
            )
            widening = "-"
            if m <= QUANTIZED_SMALL_ROWS and cpu_gemv.available():
                loop = macs / best_seconds(
                    lambda: cpu_gemv.small_gemm_int4(x, int4.packed4, int4.scale4, int4.offset4)  # noqa: B023
                )
                widening = f"{loop:.1f}"
            print(
                f"| {n} | {k} | {m} | {ours:.1f} | {torch_int4:.1f} | {widening} | {fp32:.1f} |", flush=True
            )


if __name__ == "__main__":
    main()
