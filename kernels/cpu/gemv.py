"""Weight-only int4 CPU projections at a few rows on CPUs without AVX-512 VNNI: a loop that
widens each group of 32 int4 weights to fp32 in registers (``w = q * s + c``) and multiplies
it with up to four activation rows, each thread streaming its weight rows one after the other.

The fp32 and int8 loops that once lived here (the engine's small-batch kernels) gave way to
``packed_gemm``, which runs every row count and measured as fast or
faster from one row up (benchmarks/RESULTS.md); where the CPU has VNNI, int4 runs
``int4_vnni`` instead of this loop.

Built once per machine by ``build`` (Inductor's C++ driver and cache); where no compiler
works, ``available()`` is false and callers keep PyTorch's kernels. Each output is one dot
product in a fixed order, whatever the other rows.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels.cpu import build

ARGTYPES_I4 = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]


@functools.cache
def library() -> ctypes.CDLL | None:
    """Build (or load from Inductor's cache) the kernel; None where that fails."""
    lib = build.load(build.source("gemv.cpp"))
    if lib is not None:
        build.bind(lib, "gemv_i4", ARGTYPES_I4)
    return lib


def available() -> bool:
    """Whether the kernel built on this machine (built on the first call)."""
    return library() is not None


def small_gemm_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for int4 ``W`` packed [N, K / 2] (groups of 32; byte j of a group
    holds q[j] and q[j + 16]), ``W = q * scale + offset`` with fp32 ``scale``/``offset``
    [N, K / 32]; fp32 activations and accumulation. Returns fp32 [M, N]."""
    lib = library()
    if lib is None:
        raise RuntimeError("the small-batch CPU kernel did not build on this machine")
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or k % 32:
        raise ValueError(f"small_gemm_int4: x has {k} columns, packed weight {tuple(packed.shape)}")
    xf = x.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    lib.gemv_i4(
        xf.data_ptr(),
        packed.data_ptr(),
        scale.data_ptr(),
        offset.data_ptr(),
        None if bf is None else bf.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y
