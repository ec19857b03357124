"""fp32 and int8-weight CPU projections (``y = x @ W.T * scale + b``) on a packed copy of ``W``,
at any row count.

oneDNN's packed fp32 GEMM, which the engine's Llama steps ran above 16 rows before, reached
well below its prefill-size rate at 16-64 rows on SmolLM2's projection stack (weights streamed
from memory): between "read every weight once" and "compute-bound" it kept neither the memory
nor the FMA units busy. This kernel keeps both busy with one plain loop:
- ``W`` is packed once into tiles of two vectors of output channels (32 on AVX-512), K-major:
  tile ``t`` holds ``W[32t:32(t+1), k]`` for k = 0..K-1 one after the other, so a tile is one
  linear stream;
- a pass holds the tile's two vectors times ``MR`` activation rows of accumulators in
  registers (12 rows on AVX-512: 24 of its 32 vector registers), and per k loads two weight
  vectors and broadcasts ``MR`` activations: 24 FMAs for two loads;
- one pass (up to ``MR`` rows) prefetches 8 KiB ahead along its own stream; more passes re-read
  the tile (K x 32 floats, 72 KiB at K = 576) from L2 while prefetching the next tile, so the
  memory stream runs under the compute;
- many rows (``8 MR`` or more) against a packed weight of at most 128 KiB (the tiny V4's
  projections at prefill sizes) run rows first: each block of ``MR`` rows meets every tile
  while its activations are in L1, the blocks split over the threads.
It runs SmolLM2's projection stack faster than oneDNN at every row count measured, most at
1-64 rows; against the fp32 loop it replaced (``gemv``'s, which read the unpacked weights)
it is level at one row, where both stream at the memory bound, and ahead at 4-16 rows
(``benchmarks/cpu_packed_gemm.py``; figures in benchmarks/RESULTS.md).
int8 weights (weight-only ``quantization="int8"``) widen to fp32 in registers, times the fp16
scale of their group of 32 inputs (Q8_0's blocks): fp32 activations and accumulation, 8.5 bits
a weight.
bf16 weights (``dtype="bfloat16"``) widen exactly (a shift) with fp32 activations and sums, the
precision of oneDNN's bf16 product: small row counts stream half the bytes of fp32, where
oneDNN's AMX kernel read the same weights below the memory bound (benchmarks/RESULTS.md).

Each output is one FMA chain over k in order, started at zero (an int8 weight scaled before
its FMA), then the bias:
the same operations whatever the row count, tile or thread split, so a row's result is bitwise
the same alone, batched, or inside a prefill (batch-invariant at every M).

Built once per machine by ``build``; ``available()`` is false where no compiler works, and
callers keep oneDNN (fp32) or PyTorch's kernels (int8).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels.cpu import build

# weight dtypes the kernel reads: fp32, bf16 (widened exactly), int8 (times an fp16 scale per
# GROUP inputs of an output)
DTYPES = (torch.float32, torch.bfloat16, torch.int8)
GROUP = 32
ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
ARGTYPES_I8 = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]


@functools.cache
def library() -> ctypes.CDLL | None:
    """Build (or load from Inductor's cache) the kernel; None where that fails."""
    lib = build.load(build.source("packed_gemm.cpp"))
    if lib is not None:
        build.bind(lib, "packed_gemm_f32", ARGTYPES)
        build.bind(lib, "packed_gemm_i8", ARGTYPES_I8)
        build.bind(lib, "packed_gemm_bf16", ARGTYPES)
        build.bind(lib, "packed_gemm_width", []).restype = ctypes.c_int64
    return lib


def available() -> bool:
    """Whether the kernel built on this machine (built on the first call)."""
    return library() is not None


@functools.cache
def width() -> int:
    """Output channels per packed tile: two vectors of fp32 lanes of the ISA the kernel was
    built for (32 on AVX-512)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the packed fp32/int8 CPU kernel did not build on this machine")
    return int(lib.packed_gemm_width())


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is what the kernel packs: a 2-D fp32, bf16 or int8 CPU matrix."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in DTYPES and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (fp32, bf16, or int8 values that meet their group scales in ``gemm``) as the
    kernel reads it: [ceil(N / T), K, T] of the same dtype with T = ``width()`` outputs per
    tile, output channels past N zero. A copy, without autograd."""
    if not supports(weight):
        raise ValueError(
            f"pack: needs a 2-D fp32, bf16 or int8 CPU weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    v = width()
    blocks = -(-n // v)
    padded = torch.zeros(blocks * v, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.view(blocks, v, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, K] weight ``pack`` was given."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """int8 weights' scales [N, ceil(K / 32)] (one per 32 inputs of an output) as the kernel
    reads them: fp16, [ceil(N / T), ceil(K / 32), T], outputs past N zero."""
    n, groups = scales.shape
    v = width()
    blocks = -(-n // v)
    padded = torch.zeros(blocks * v, groups, dtype=torch.float16)
    padded[:n] = scales.detach().to(torch.float16)
    return padded.view(blocks, v, groups).transpose(1, 2).contiguous()


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` [M, K] (any float dtype, computed in fp32), ``W`` packed by
    ``pack`` (``out_features`` rows; int8 ones need ``scale``, their group scales packed by
    ``pack_scales``; fp32 and bf16 ones take none), ``bias`` [out_features] or None. Returns
    fp32 [M, N]."""
    lib = library()
    if lib is None:
        raise RuntimeError("the packed CPU kernel did not build on this machine")
    m, k = x.shape
    v = width()
    if packed.dim() != 3 or packed.shape[1:] != (k, v) or packed.shape[0] * v < out_features:
        raise ValueError(
            f"packed gemm: x has {k} columns, packed weight {tuple(packed.shape)} for {out_features} outputs"
        )
    if packed.dtype not in DTYPES or not packed.is_contiguous():
        raise ValueError("packed gemm: the packed weight must be contiguous fp32, bf16 or int8 (from pack())")
    if (scale is None) != (packed.dtype != torch.int8):
        raise ValueError(
            "packed gemm: int8 weights need their packed group scales, fp32 and bf16 weights none"
        )
    groups = -(-k // GROUP)
    if scale is not None and (
        scale.dtype != torch.float16
        or scale.shape != (packed.shape[0], groups, v)
        or not scale.is_contiguous()
    ):
        raise ValueError(
            f"packed gemm: int8 scales must be pack_scales' fp16 {(packed.shape[0], groups, v)}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    xf = x.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()  # kept alive across the call
    b = None if bf is None else bf.data_ptr()
    y = torch.empty(m, out_features, dtype=torch.float32)
    threads = torch.get_num_threads()
    if packed.dtype == torch.bfloat16:
        lib.packed_gemm_bf16(xf.data_ptr(), packed.data_ptr(), b, y.data_ptr(), m, out_features, k, threads)
    elif scale is None:
        lib.packed_gemm_f32(xf.data_ptr(), packed.data_ptr(), b, y.data_ptr(), m, out_features, k, threads)
    else:
        lib.packed_gemm_i8(
            xf.data_ptr(), packed.data_ptr(), scale.data_ptr(), b, y.data_ptr(), m, out_features, k, threads
        )
    return y
