"""Decode attention over the paged K/V pools, read in place, on the CPU.

The reference decode path gathers every decode token's cached rows into a dense copy and
runs SDPA on it: a dozen ATen calls and a copy of the sequence's K and V per layer per step,
most of a small decode step's time outside the projections. This kernel reads each cached
row straight from the pool through the step's ``decode_kv`` row indices, one pass per
(token, head): scores, a max-subtracted softmax in fp32, and the weighted sum of values. GQA
heads share their K/V head. Built once per machine by ``cpu_build``; fp32 and bf16 pools.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from deepinfer.kernels import cpu_build

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  if constexpr (std::is_same_v<T, float>) {
    Vec acc(0.f);
    int64_t i = 0;
    for (; i + Vec::size() <= d; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(q + i), Vec::loadu(k + i), acc);
    alignas(64) float b[Vec::size()];
    acc.store(b);
    for (int j = 0; j < Vec::size(); ++j) s += b[j];
    for (; i < d; ++i) s += q[i] * k[i];
  } else {
    for (int64_t i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  }
  return s;
}

// q, out [T, H, d] fp32; pools [rows, n_kv * d]; rows [n] (-1: padding); kv, valid [n, L]
template <typename T>
void decode_attention(const float* q, const T* k, const T* v, const int64_t* rows, const int64_t* kv,
                      const bool* valid, float* out, int64_t n, int64_t L, int64_t H, int64_t n_kv,
                      int64_t d, float scale, int threads) {
  const int64_t group = H / n_kv;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(L);
    std::vector<float> acc(d);
#pragma omp for collapse(2) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = rows[i];
        if (row < 0) continue;
        const int64_t g = h / group;
        const float* qh = q + (row * H + h) * d;
        const int64_t* kvi = kv + i * L;
        const bool* ok = valid + i * L;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t l = 0; l < L; ++l) {
          if (!ok[l]) continue;
          p[l] = dot<T>(qh, k + kvi[l] * n_kv * d + g * d, d) * scale;
          mx = std::max(mx, p[l]);
        }
        float* o = out + (row * H + h) * d;
        if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible
          for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
          continue;
        }
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          if (!ok[l]) continue;
          p[l] = std::exp(p[l] - mx);
          sum += p[l];
        }
        for (int64_t j = 0; j < d; ++j) acc[j] = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          if (!ok[l]) continue;
          const T* vr = v + kvi[l] * n_kv * d + g * d;
          const float w = p[l];
          if constexpr (std::is_same_v<T, float>) {
            int64_t j = 0;
            for (; j + Vec::size() <= d; j += Vec::size())
              at::vec::fmadd(Vec(w), Vec::loadu(vr + j), Vec::loadu(acc.data() + j)).store(acc.data() + j);
            for (; j < d; ++j) acc[j] += w * vr[j];
          } else {
            for (int64_t j = 0; j < d; ++j) acc[j] += w * to_f(vr[j]);
          }
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < d; ++j) o[j] = acc[j] * inv;
      }
    }
  }
}

extern "C" {
void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* rows,
                          const int64_t* kv, const bool* valid, float* out, int64_t n, int64_t L,
                          int64_t H, int64_t n_kv, int64_t d, float scale, int threads) {
  decode_attention<float>(q, k, v, rows, kv, valid, out, n, L, H, n_kv, d, scale, threads);
}
void decode_attention_bf16(const float* q, const at::BFloat16* k, const at::BFloat16* v,
                           const int64_t* rows, const int64_t* kv, const bool* valid, float* out,
                           int64_t n, int64_t L, int64_t H, int64_t n_kv, int64_t d, float scale,
                           int threads) {
  decode_attention<at::BFloat16>(q, k, v, rows, kv, valid, out, n, L, H, n_kv, d, scale, threads);
}
}
"""

_ENTRY = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
        for name in _ENTRY.values():
            cpu_build.bind(lib, name, args)
    return lib


def supports(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """CPU, no autograd (the research path keeps the differentiable reference), pools of one
    dtype the kernel reads, contiguous."""
    return (
        q.device.type == "cpu"
        and not (q.requires_grad or k_pool.requires_grad or v_pool.requires_grad)
        and k_pool.dtype == v_pool.dtype
        and k_pool.dtype in _ENTRY
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and _library() is not None
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
    lib = _library()
    assert lib is not None
    _, h, d = q.shape
    n, length = decode_kv.shape
    qf = q.float().contiguous()
    rows = decode_rows.contiguous()
    kv = decode_kv.contiguous()
    valid = decode_valid.contiguous()
    getattr(lib, _ENTRY[k_pool.dtype])(
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
        k_pool.shape[1] // d,
        d,
        1.0 / math.sqrt(d),
        torch.get_num_threads(),
    )
