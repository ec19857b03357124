"""Llama's RoPE on q and k plus the K/V cache writes as one launch on CUDA:
``deepinfer::rope_store``, with a Triton kernel.

In eager PyTorch the rotate-half RoPE of a fused q/k/v projection, its casts and the two
cache writes are about a dozen launches per layer. Here one program per (token, head) of
``qkv`` loads the head's two halves once and, for a q or k head, rotates them in fp32 as
``rotate_half_rope`` does (a product, a product, then the sum, with no fused multiply-add:
``enable_fp_fusion=False``), rounds to the activations' dtype and stores q into the op's
output or k at the token's pool row; a v head is stored as it is. Pools are plain float
tensors (8-bit caches, which rotate keys into another basis, keep the plain path in
``models/layers/dispatch.py``). The op's default implementation is that plain path's math
(``reference``), which every device without the kernel runs. The kernel is defined at the
first CUDA call, so CPU-only machines never import Triton; it also runs under
``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepinfer.kernels.rope import rotate_half_rope
from deepinfer.kernels.triton_support import triton_installed

# pool and activation element types the op takes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
) -> torch.Tensor:
    """``models/layers/dispatch.py``'s plain path for float pools: ``rotate_half_rope`` of the
    q and k heads, k and v written at ``rows`` in the pools' dtype; returns q."""
    t = qkv.shape[0]
    qk = rotate_half_rope(qkv[:, : (n_heads + n_kv) * head_dim].reshape(t, -1, head_dim), cos, sin)
    k_pool.index_copy_(0, rows, qk[:, n_heads:].reshape(t, -1).to(k_pool.dtype))
    v_pool.index_copy_(0, rows, qkv[:, (n_heads + n_kv) * head_dim :].to(v_pool.dtype))
    return qk[:, :n_heads]


@torch.library.custom_op("deepinfer::rope_store", mutates_args=("k_pool", "v_pool"))
def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
) -> torch.Tensor:
    """``qkv`` [T, (n_heads + 2 n_kv) head_dim] (q, k, v heads side by side); ``cos``/``sin``
    [T, 1, head_dim / 2] fp32; ``rows`` [T] pool rows. Writes rotated k and v into the pools;
    returns rotated q [T, n_heads, head_dim] in ``qkv``'s dtype, contiguous."""
    return reference(qkv, cos, sin, rows, k_pool, v_pool, n_heads, n_kv, head_dim).contiguous()


@rope_store.register_fake
def _(qkv, cos, sin, rows, k_pool, v_pool, n_heads, n_kv, head_dim):
    return qkv.new_empty(qkv.shape[0], n_heads, head_dim)


def takes(qkv: torch.Tensor, cos: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Triton installed, float activations and pools, fp32 angles, unit-stride rows,
    contiguous pools."""
    return (
        triton_installed()
        and qkv.dtype in DTYPES
        and cos.dtype == torch.float32
        and k_pool.dtype in DTYPES
        and v_pool.dtype in DTYPES
        and qkv.dim() == 2
        and qkv.stride(-1) == 1
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
    )


@rope_store.register_kernel("cuda")
def _cuda(qkv, cos, sin, rows, k_pool, v_pool, n_heads, n_kv, head_dim) -> torch.Tensor:
    if takes(qkv, cos, k_pool, v_pool) and sin.dtype == torch.float32:
        return rope_store_triton(qkv, cos, sin, rows, k_pool, v_pool, n_heads, n_kv, head_dim)
    return reference(qkv, cos, sin, rows, k_pool, v_pool, n_heads, n_kv, head_dim).contiguous()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_store(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        rows_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        rows_stride,
        qkv_stride,
        cos_stride,
        sin_stride,
        k_stride,
        v_stride,
        n_heads,
        n_kv,
        half,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)  # token
        h = tl.program_id(1)  # head of qkv: q heads, then k heads, then v heads
        j = tl.arange(0, BLOCK)
        ok = j < half
        src = qkv_ptr + t * qkv_stride + h * (2 * half)
        x1 = tl.load(src + j, mask=ok, other=0.0)
        x2 = tl.load(src + half + j, mask=ok, other=0.0)
        if h < n_heads + n_kv:
            c = tl.load(cos_ptr + t * cos_stride + j, mask=ok, other=0.0)
            s = tl.load(sin_ptr + t * sin_stride + j, mask=ok, other=0.0)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            lo = (a * c - b * s).to(x1.dtype)
            hi = (b * c + a * s).to(x1.dtype)
            if h < n_heads:
                dst = q_ptr + (t * n_heads + h) * (2 * half)
                tl.store(dst + j, lo, mask=ok)
                tl.store(dst + half + j, hi, mask=ok)
            else:
                row = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
                dst = k_ptr + row * k_stride + (h - n_heads) * (2 * half)
                tl.store(dst + j, lo.to(k_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + half + j, hi.to(k_ptr.dtype.element_ty), mask=ok)
        else:
            row = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
            dst = v_ptr + row * v_stride + (h - n_heads - n_kv) * (2 * half)
            tl.store(dst + j, x1.to(v_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + j, x2.to(v_ptr.dtype.element_ty), mask=ok)

    return _rope_store


def rope_store_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
) -> torch.Tensor:
    """Same contract as ``deepinfer::rope_store`` (``takes`` holds): one launch."""
    import triton

    t, half = qkv.shape[0], head_dim // 2
    q = qkv.new_empty(t, n_heads, head_dim)
    if t == 0:
        return q
    c, s = cos.reshape(t, half), sin.reshape(t, half)
    c = c if c.stride(-1) == 1 else c.contiguous()
    s = s if s.stride(-1) == 1 else s.contiguous()
    _kernel()[(t, n_heads + 2 * n_kv)](
        qkv,
        c,
        s,
        rows,
        q,
        k_pool,
        v_pool,
        rows.stride(0),
        qkv.stride(0),
        c.stride(0),
        s.stride(0),
        k_pool.stride(0),
        v_pool.stride(0),
        n_heads,
        n_kv,
        half,
        BLOCK=max(16, triton.next_power_of_2(half)),
        num_warps=1 if half <= 64 else 2,
        enable_fp_fusion=False,  # the reference's products and sums round apart
    )
    return q
