"""Decode attention over the paged K/V pools, read in place, on the CPU.

The reference decode path gathers every decode token's cached rows into a dense copy and
runs SDPA on it: a dozen ATen calls and a copy of the sequence's K and V per layer per step,
most of a small decode step's time outside the projections. This kernel reads each cached
row straight from the pool through the step's ``decode_kv`` row indices, one work item per
(token, K/V head): the query heads sharing that K/V head are done together, with queries and
output accumulators in registers, so each cached row is read once per item; scores, a
max-subtracted softmax in fp32 (vectorised exp) and the weighted sum of values, about three
times as fast as the per-head loop it replaced at 8-32 decode rows (benchmarks/RESULTS.md). A
sequence's rows sit in blocks scattered over the pool, which the hardware's prefetchers do not
follow, so the score pass fetches the K and V rows ``AHEAD`` keys ahead, which shortens
SmolLM2-shaped decode steps with fp32 and fp16 pools alike (benchmarks/RESULTS.md). Built once
per machine by ``build``; fp32, bf16, fp16, fp8 and int8 pools
(``fp8``).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from deepinfer.kernels import batch_invariant, kv_int8
from deepinfer.kernels.cpu import build, fp8

ENTRY = {dtype: f"decode_attention_{name}" for dtype, name in fp8.POOL_NAMES.items()}


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("attention.cpp"))
    if lib is not None:
        args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
        for name in ENTRY.values():
            build.bind(lib, name, args)
    return lib


def supports(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """CPU, no autograd (the research path keeps the differentiable reference), pools of one
    dtype the kernel reads, contiguous."""
    return (
        q.device.type == "cpu"
        and not (q.requires_grad or k_pool.requires_grad or v_pool.requires_grad)
        and not batch_invariant.active()
        and k_pool.dtype == v_pool.dtype
        and fp8.reads_heads(k_pool.dtype, q.shape[-1])
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and library() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write attention of the decode rows of ``q`` [T, H, d] into ``out`` [>= T, H, d] (fp32,
    contiguous) in place, with SDPA's default scale 1/sqrt(d). Rows of -1 are skipped."""
    lib = library()
    assert lib is not None
    _, h, d = q.shape
    n, length = decode_kv.shape
    qf = q.float().contiguous()
    rows = decode_rows.contiguous()
    kv = decode_kv.contiguous()
    valid = decode_valid.contiguous()
    getattr(lib, ENTRY[k_pool.dtype])(
        qf.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        rows.data_ptr(),
        kv.data_ptr(),
        valid.data_ptr(),
        out.data_ptr(),
        n,
        length,
        h,
        kv_int8.values_per_row(k_pool) // d,
        d,
        1.0 / math.sqrt(d),
        torch.get_num_threads(),
    )
