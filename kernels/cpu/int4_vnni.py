"""int4 weights times int8 activations, on AVX-512 VNNI or AVX2: weight-only int4 projections
at every row count, where PyTorch's int4 kernel (bf16 activations) and an fp32 widening loop
are compute-bound.

llama.cpp's Q4_0 path quantizes activations to int8 per group of 32 and multiplies bytes
(``vpdpbusd``: 64 multiply-adds per instruction against 16 for an fp32 FMA); this kernel does
the same with our int4 format (``w = (q - 8) * s + z`` per group of 32 with fp16 ``s`` and
``z``, ``weight_only``; fp16 as llama.cpp's Q4_1 stores its scale and minimum: bf16's 8-bit
mantissa moves every weight of a group by a share of its step). Sixteen weight rows share a
vector, one per 32-bit lane, and a broadcast word of four activation bytes meets all sixteen:
eight ``vpdpbusd`` finish one group for sixteen rows, which then meet their sixteen weight
scales and the group's activation scale with one multiply and one FMA (the offsets add
``c * s_x * sum(x_q)`` the same way). The results leave as whole vectors of sixteen outputs,
with no horizontal sums, and any K that is a multiple of 32 fills every lane. (The first
version put sixteen groups of one row in a vector and summed its lanes at the end: at K = 576
that reduction, and a tail tile of 2 groups in 16 lanes, held it to under half this layout's
rate; benchmarks/RESULTS.md.)
Each block of sixteen rows is one stream: per group, its nibbles, then its scales and zeros.
Activations round to int8 per group (``s_x = max|x| / 127``), so results differ from the
fp32-activation loop by that rounding, as llama.cpp's do.

CPUs without VNNI but with AVX2 (AMD Zen 2/3, Intel before Ice Lake) read the same blocks as
two halves of eight rows: ``vpmaddubsw`` multiplies bytes and adds pairs into int16, a group's
eight of those add exactly in int16, and one ``vpmaddwd`` by ones ends the group in int32, as
llama.cpp's AVX2 Q4_0 dot does; every step after the group sums is the VNNI path's, operation
for operation, so both paths should give the same bits (the kernel test compares them on a CPU
that runs both). On AVX2 it ran several times faster than PyTorch's int4 kernel at 8-512 rows
and than the widening loop at 1-4 rows, whose AVX2 build is scalar (benchmarks/RESULTS.md).

A row's result depends only on its own activations and the weights (fixed order), so it is
the same whatever it is batched with. Built once per machine by ``build``; ``available()``
is false without a compiler or without AVX-512 VNNI or AVX2, and callers keep PyTorch's kernel.
(The module keeps its first name, from when VNNI was the only path.)
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels.cpu import build

GROUP = 32
BLOCK = 16  # weight rows per vector (one per 32-bit lane of a 512-bit register)


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("int4_vnni.cpp"))
    if lib is None:
        return None
    lib.int8_dot_isa.restype = ctypes.c_int
    if not lib.int8_dot_isa():
        return None
    build.bind(lib, "pack_weights", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2)
    build.bind(lib, "gemm_i4_i8", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int])
    args = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    build.bind(lib, "gemm_i4_i8_isa", args)
    return lib


def available() -> bool:
    """A compiler and a CPU with AVX-512 VNNI or AVX2."""
    return library() is not None


_ISAS = {2: "avx512-vnni", 1: "avx2"}
_CODES = {name: code for code, name in _ISAS.items()}


@functools.cache
def _best_code() -> int:
    """The best path's code on this CPU (asked once: the CPU does not change under us)."""
    lib = library()
    return lib.int8_dot_isa() if lib is not None else 0


def isa() -> str:
    """The instructions the kernel multiplies bytes with on this CPU: ``"avx512-vnni"``,
    ``"avx2"`` or ``"none"``."""
    return _ISAS.get(_best_code(), "none")


def isas() -> list[str]:
    """Every path this CPU can run (an AVX-512 VNNI CPU runs the AVX2 one too), for tests
    that hold the paths to the same bits."""
    return [name for code, name in _ISAS.items() if code <= _best_code()]


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] (0..15, K a multiple of 32) with fp16 ``scale`` / ``zero``
    [N, K / 32] (``w = (q - 8) * scale + zero``, PyTorch's int4 form) -> the kernel's packed
    blocks as [N rounded up to 16, K / 2 + 4 K / 32] uint8 (as many bytes per row as
    PyTorch's layout; the padding rows are zero)."""
    lib = library()
    assert lib is not None
    q = q.to(torch.uint8).contiguous()
    n, k = q.shape
    s = scale.to(torch.float16).contiguous().view(torch.int16)
    c = zero.to(torch.float16).contiguous().view(torch.int16)
    packed = torch.empty(-(-n // BLOCK) * BLOCK, k // 2 + 4 * (k // GROUP), dtype=torch.uint8)
    lib.pack_weights(q.data_ptr(), s.data_ptr(), c.data_ptr(), packed.data_ptr(), n, k)
    return packed


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """fp32 ``x [M, K] @ W.T (+ bias)`` [M, out_features] for ``W`` [out_features, K] packed by
    ``pack``, with the activations rounded to int8 per group of 32. ``path``: one of
    ``isas()`` (default: the best this CPU has)."""
    lib = library()
    assert lib is not None
    x = x.float().contiguous()
    m, k = x.shape
    n = out_features
    rows = -(-n // BLOCK) * BLOCK
    if k % GROUP or packed.shape != (rows, k // 2 + 4 * (k // GROUP)):
        raise ValueError(f"gemm: x has {k} columns, packed weight {tuple(packed.shape)} for {n} rows")
    y = torch.empty(m, n)
    scratch = torch.empty(m * k + 8 * m * (k // GROUP), dtype=torch.uint8)
    b = bias.float().contiguous() if bias is not None else None
    code = _best_code()
    if path is not None:
        if path not in isas():
            raise ValueError(f"gemm: path {path!r} is not one of this CPU's {isas()}")
        code = _CODES[path]
    lib.gemm_i4_i8_isa(
        code,
        x.data_ptr(),
        packed.data_ptr(),
        b.data_ptr() if b is not None else None,
        y.data_ptr(),
        scratch.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y
