"""Llama's RoPE on q and k plus the K/V cache writes, as one CPU call per layer.

In an eager decode step the rotate-half RoPE, the split of the fused q/k/v projection and the
two cache writes are about fifteen small ATen calls per layer, each costing more in dispatch
than in arithmetic. This kernel does the same arithmetic in one pass: each head's halves are
rotated in fp32 exactly as ``rotate_half_rope`` does (a product, a product, a sum: no fused
multiply-add, as Inductor's flags forbid contraction), rounded to the activations' dtype, and
k and v are stored at the step's pool rows in the pool's dtype (fp8 saturated, as
``kv_dtypes.store`` does). Results are bitwise the reference's. A prefill's tokens (64 or
more) split over ATen's threads; decode runs on the calling one. Built once per machine by
``cpu_build``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build, cpu_fp8

_SOURCE = (
    cpu_fp8.SOURCE
    + r"""
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <ATen/Parallel.h>
#include <cstdint>

constexpr int64_t PARALLEL_TOKENS = 64;

template <typename A, typename P>
void rope_store(const A* qkv, const float* cos, const float* sin, const int64_t* rows, P* k_pool,
                P* v_pool, A* q_out, int64_t T, int64_t H, int64_t KV, int64_t d) {
  const int64_t half = d / 2, width = (H + 2 * KV) * d;
  // tokens are independent: a prefill's split over ATen's threads (as many as PyTorch is set
  // to), a decode step's few run inline on the calling thread
  at::parallel_for(0, T, PARALLEL_TOKENS, [&](int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    const A* x = qkv + t * width;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    P* kr = k_pool + rows[t] * KV * d;
    P* vr = v_pool + rows[t] * KV * d;
    for (int64_t h = 0; h < H + KV; ++h) {
      const A* xh = x + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
        const float p1 = x1 * c[i], p2 = x2 * s[i], p3 = x2 * c[i], p4 = x1 * s[i];
        const A a = static_cast<A>(p1 - p2), b = static_cast<A>(p3 + p4);
        if (h < H) {
          q_out[(t * H + h) * d + i] = a;
          q_out[(t * H + h) * d + i + half] = b;
        } else {
          kr[(h - H) * d + i] = to_pool<P>(static_cast<float>(a));
          kr[(h - H) * d + i + half] = to_pool<P>(static_cast<float>(b));
        }
      }
    }
    const A* v = x + (H + KV) * d;
    for (int64_t i = 0; i < KV * d; ++i) vr[i] = to_pool<P>(static_cast<float>(v[i]));
  }
  });
}

#define ENTRY(NAME, A, P)                                                                        \
  extern "C" void NAME(const A* qkv, const float* c, const float* s, const int64_t* rows, P* k,  \
                       P* v, A* q, int64_t T, int64_t H, int64_t KV, int64_t d) {                \
    rope_store<A, P>(qkv, c, s, rows, k, v, q, T, H, KV, d);                                    \
  }
ENTRY(rope_store_f32_f32, float, float)
ENTRY(rope_store_f32_bf16, float, c10::BFloat16)
ENTRY(rope_store_bf16_f32, c10::BFloat16, float)
ENTRY(rope_store_bf16_bf16, c10::BFloat16, c10::BFloat16)
ENTRY(rope_store_f32_f16, float, c10::Half)
ENTRY(rope_store_bf16_f16, c10::BFloat16, c10::Half)
ENTRY(rope_store_f32_e4m3, float, c10::Float8_e4m3fn)
ENTRY(rope_store_bf16_e4m3, c10::BFloat16, c10::Float8_e4m3fn)
ENTRY(rope_store_f32_e5m2, float, c10::Float8_e5m2)
ENTRY(rope_store_bf16_e5m2, c10::BFloat16, c10::Float8_e5m2)
"""
)

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # activations


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        for a in _NAMES.values():
            for p in cpu_fp8.POOL_NAMES.values():
                cpu_build.bind(lib, f"rope_store_{a}_{p}", [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4)
    return lib


def supports(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """CPU, no autograd, dtypes the kernel has, contiguous pools."""
    return (
        qkv.device.type == "cpu"
        and not qkv.requires_grad
        and qkv.dtype in _NAMES
        and k_pool.dtype == v_pool.dtype
        and k_pool.dtype in cpu_fp8.POOL_NAMES
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and _library() is not None
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
    lib = _library()
    assert lib is not None
    t = qkv.shape[0]
    x = qkv.contiguous()
    c, s = cos.reshape(t, -1).float().contiguous(), sin.reshape(t, -1).float().contiguous()
    r = rows.contiguous()
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype)
    getattr(lib, f"rope_store_{_NAMES[qkv.dtype]}_{cpu_fp8.POOL_NAMES[k_pool.dtype]}")(
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
