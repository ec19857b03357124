"""Llama's RoPE on q and k plus the K/V cache writes, as one CPU call per layer.

In an eager decode step the rotate-half RoPE, the split of the fused q/k/v projection and the
two cache writes are about fifteen small ATen calls per layer, each costing more in dispatch
than in arithmetic. This kernel does the same arithmetic in one pass: each head's halves are
rotated in fp32 exactly as ``rotate_half_rope`` does (a product, a product, a sum: no fused
multiply-add, as Inductor's flags forbid contraction), rounded to the activations' dtype, and
k and v are stored at the step's pool rows in the pool's dtype (fp8 saturated, as
``kv_dtypes.store`` does; for an int8 or fp8 pool q and k are first rotated as
``kv_rotation.rotate`` does, and an int8 row is encoded whole). Results are bitwise the reference's. A prefill's tokens (64 or
more) split over ATen's threads; decode runs on the calling one. Built once per machine by
``build``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build, fp8

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # activations


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("rope_store.cpp"))
    if lib is not None:
        for a in _NAMES.values():
            for p in fp8.POOL_NAMES.values():
                build.bind(lib, f"rope_store_{a}_{p}", [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4)
    return lib


def supports(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """CPU, no autograd, dtypes the kernel has, contiguous pools."""
    return (
        qkv.device.type == "cpu"
        and not qkv.requires_grad
        and not batch_invariant.active()
        and qkv.dtype in _NAMES
        and k_pool.dtype == v_pool.dtype
        and k_pool.dtype in fp8.POOL_NAMES
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and library() is not None
    )


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """``qkv`` [T, (heads + 2 kv_heads) * head_dim]; ``cos``/``sin`` [T, head_dim / 2] fp32;
    ``rows`` [T] pool rows. Writes rotated k and v into the pools; returns rotated q
    [T, heads, head_dim] in ``qkv``'s dtype."""
    lib = library()
    assert lib is not None
    t = qkv.shape[0]
    x = qkv.contiguous()
    c, s = cos.reshape(t, -1).float().contiguous(), sin.reshape(t, -1).float().contiguous()
    r = rows.contiguous()
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype)
    getattr(lib, f"rope_store_{_NAMES[qkv.dtype]}_{fp8.POOL_NAMES[k_pool.dtype]}")(
        x.data_ptr(),
        c.data_ptr(),
        s.data_ptr(),
        r.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        q.data_ptr(),
        t,
        heads,
        kv_heads,
        head_dim,
    )
    return q
