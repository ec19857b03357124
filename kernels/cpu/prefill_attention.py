"""Causal prefill attention over the paged K/V pools on the CPU, every span of a step in one call.

PyTorch's CPU SDPA ran SmolLM2's short prompts (9 query heads over 3 K/V heads) far below the
CPU's FMA rate, a sizeable share of the prefill (benchmarks/RESULTS.md): at these sizes its blocks
are too small for the GEMMs it calls. This kernel treats
each (span, K/V head, block of query positions) as one work item: the query heads sharing the
K/V head and a few positions make ~12 rows, whose scores against every visible key come from
register tiles (a vector of keys times a broadcast query element, as ``packed_gemm`` does,
over K transposed into blocks of one vector of keys once per span and head), then a
max-subtracted fp32 softmax (ATen's vectorised exp, as the decode kernel uses) and the weighted
sum of values from register tiles of rows x (up to four vectors of) the head. Keys past a
block's last position are never computed (causal), and the pool rows are read in place while
packing (fp32, bf16, fp16, fp8, int8: ``fp8``).

Head sizes that are a multiple of the vector width up to eight vectors (16-128 on AVX-512) take
this path; others keep SDPA. Built once per machine by ``build``.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from deepinfer.kernels import batch_invariant, kv_int8
from deepinfer.kernels.cpu import build, fp8

ENTRY = {dtype: f"prefill_attention_{name}" for dtype, name in fp8.POOL_NAMES.items()}
ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("prefill_attention.cpp"))
    if lib is not None:
        for name in ENTRY.values():
            build.bind(lib, name, ARGTYPES)
        build.bind(lib, "prefill_attention_width", []).restype = ctypes.c_int64
    return lib


def supports(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """CPU, no autograd (the research path keeps the differentiable reference), pools of one
    dtype the kernel reads, contiguous, a head size of 1, 2, 4 or 8 vectors."""
    if q.device.type != "cpu" or q.requires_grad or k_pool.requires_grad or v_pool.requires_grad:
        return False
    if batch_invariant.active():
        return False
    if k_pool.dtype != v_pool.dtype or not fp8.reads_heads(k_pool.dtype, q.shape[-1]):
        return False
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        return False
    width = _width()
    return width > 0 and q.shape[-1] % width == 0 and q.shape[-1] // width in (1, 2, 4, 8)


@functools.cache
def _width() -> int:
    """The vector width in fp32 lanes the kernel was built for (0: not built)."""
    lib = library()
    return 0 if lib is None else int(lib.prefill_attention_width())


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    span_meta: torch.Tensor,
    span_kv_rows: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write causal attention of every prefill span of ``q`` [T, H, d] into ``out`` [>= T, H,
    d] (fp32, contiguous) in place, with SDPA's default scale 1/sqrt(d); ``span_meta`` and
    ``span_kv_rows`` as ``paged_attention_reference`` takes them (spans of 0 tokens skipped)."""
    lib = library()
    assert lib is not None
    _, h, d = q.shape
    qf = q.float().contiguous()
    spans = span_meta.to(torch.int64).contiguous()
    rows = span_kv_rows.to(torch.int64).contiguous()
    getattr(lib, ENTRY[k_pool.dtype])(
        qf.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        spans.data_ptr(),
        rows.data_ptr(),
        out.data_ptr(),
        spans.shape[0],
        h,
        kv_int8.values_per_row(k_pool) // d,
        d,
        1.0 / math.sqrt(d),
        torch.get_num_threads(),
    )
