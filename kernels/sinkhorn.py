"""Sinkhorn normalisation of the mHC stream mixer.

``reference`` is the plain PyTorch definition. On CPU the same arithmetic runs as one C++
loop (``cpu/sinkhorn.cpp``, built once per machine by ``cpu.build``): the matrices are tiny ([T, 4, 4]) and the
2 * iters row/column normalisations are pure per-op overhead in eager PyTorch.
4 x 4 matrices (V4's ``hc_mult``) run sixteen at a time, one per vector lane, softmax's exp
included. Where no compiler is available the NumPy version runs instead, whose per-call cost
is still below PyTorch's. On CUDA one Triton kernel (``sinkhorn_triton.py``) runs the
softmax and every normalisation of all the step's matrices in one launch, where the reference
makes 2 * iters + 3 per mHC site. Every path computes in fp32, matrix by matrix, so a row's
result does not depend on the batch around it.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build
from deepinfer.kernels.triton_support import triton_installed


def reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax rows, then alternate column/row normalisation, ending on columns."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


# Matrices per vector block (a multiple of every vector width), and the count from which the
# blocks split over the step's threads: with the step's other kernels keeping the team awake,
# two threads win from 64 matrices and barely differ below (benchmarks/RESULTS.md).
BLOCK = 16
THREADED_COUNT = 64
# the source's compile-time constants (``-D`` flags)
DEFINES = {"SINKHORN_BLOCK": BLOCK, "SINKHORN_THREADED_COUNT": THREADED_COUNT}


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("sinkhorn.cpp"), build.define_flags(DEFINES))
    if lib is not None:
        build.bind(
            lib, "sinkhorn_f32", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
        )
    return lib


def _cpp(comb: torch.Tensor, iters: int, eps: float, lib: ctypes.CDLL) -> torch.Tensor:
    n = comb.shape[-1]
    out = torch.empty_like(comb)
    count = comb.numel() // (n * n)
    lib.sinkhorn_f32(comb.data_ptr(), out.data_ptr(), count, n, iters, eps, torch.get_num_threads())
    return out


def _numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = torch.softmax(comb, dim=-1).numpy().copy()
    e = np.float32(eps)
    c += e
    c /= c.sum(axis=-2, keepdims=True) + e
    for _ in range(iters - 1):
        c /= c.sum(axis=-1, keepdims=True) + e
        c /= c.sum(axis=-2, keepdims=True) + e
    return torch.from_numpy(c)


@torch.library.custom_op("deepinfer::sinkhorn", mutates_args=())
def sinkhorn_op(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The custom op: opaque to ``torch.compile``, so the 2 * iters normalisations of every
    mHC site do not unroll into the traced graph (they are per-op overhead, not math)."""
    if comb.device.type == "cpu" and comb.dtype == torch.float32:
        comb = comb.contiguous()
        lib = library()
        if lib is not None:
            return _cpp(comb, iters, eps, lib)
        return _numpy(comb, iters, eps)
    return reference(comb, iters, eps).contiguous()


@sinkhorn_op.register_kernel("cuda")
def _cuda(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One Triton launch where Triton is installed (imported at the first CUDA call, so
    CPU-only machines never import it), else the reference."""
    if triton_installed():
        from deepinfer.kernels import sinkhorn_triton

        if sinkhorn_triton.takes(comb):
            return sinkhorn_triton.sinkhorn_triton(comb, iters, eps)
    return reference(comb, iters, eps).contiguous()


@sinkhorn_op.register_fake
def _(comb, iters, eps):
    # contiguous whatever comb's layout, as every path returns it: compiled CPU steps' C++
    # wrappers do not assert output layouts (``compilation.inductor_options``)
    return comb.new_empty(comb.shape)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """fp32 [..., n, n] logits -> doubly-stochastic (up to eps) mixing matrices."""
    if comb.requires_grad or batch_invariant.active():
        return reference(comb, iters, eps)
    return sinkhorn_op(comb, iters, eps)
