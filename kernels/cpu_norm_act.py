"""RMSNorm (with the residual add before it) and SwiGLU as one CPU call each, for decode.

At a few rows per step the residual add, the seven ATen calls of an fp32-statistics RMSNorm
and the chunk/SiLU/multiply of SwiGLU cost microseconds of dispatch each for nanoseconds of
arithmetic; a B=1 Llama step runs about twenty of them per layer (and in fp32 prefill the
separate SiLU and multiply passes were a visible share of the step). These kernels do the
same math in one pass per call: the sum in the activations' dtype, statistics and the weight
product in fp32, one rounding back, as ``RMSNorm`` does; SiLU as ``x / (1 + exp(-x))``, in
fp32 on ATen's vectors (a scalar ``std::exp`` loop was measurably slower).
Sums run in another order than ATen's reductions, so results agree to fp32 rounding, not
bitwise. fp32 inputs of more than ``MAX_ROWS`` rows are split by rows across ATen's threads. Built once
per machine by ``cpu_build``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>

// res = x + delta (in T; skipped when delta is null: res = x), out = T(w * res * rsqrt(mean(res^2) + eps))
template <typename T>
void add_rms_norm(const T* x, const T* delta, const float* w, T* res, T* out, int64_t rows, int64_t d,
                  float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* rr = res + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      const T v = delta ? static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(delta[r * d + i])) : xr[i];
      if (delta) rr[i] = v;
      const float f = static_cast<float>(v);
      ss += f * f;
    }
    const T* src = delta ? rr : xr;
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = static_cast<T>(w[i] * (static_cast<float>(src[i]) * inv));
  }
}

// out [rows, I] = silu(gu[:, :I]) * gu[:, I:]
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * inner;
    const T* u = g + inner;
    for (int64_t i = 0; i < inner; ++i) {
      const float x = static_cast<float>(g[i]);
      const T s = static_cast<T>(x / (1.f + std::exp(-x)));
      out[r * inner + i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
    }
  }
}

extern "C" {
// rows of prefill-sized inputs split across ATen's threads (each row's math is the same on any
// thread); decode-sized ones (up to PARALLEL_ROWS) run inline
constexpr int64_t PARALLEL_ROWS = 64;
void add_rms_norm_f32(const float* x, const float* delta, const float* w, float* res, float* out,
                      int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, PARALLEL_ROWS, [&](int64_t begin, int64_t end) {
    const int64_t o = begin * d;
    add_rms_norm<float>(x + o, delta ? delta + o : nullptr, w, res + o, out + o, end - begin, d, eps);
  });
}
void add_rms_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* delta, const float* w,
                       c10::BFloat16* res, c10::BFloat16* out, int64_t rows, int64_t d, float eps) {
  add_rms_norm<c10::BFloat16>(x, delta, w, res, out, rows, d, eps);
}
// fp32: ATen's vectorised SiLU (x / (1 + exp(-x)) on whole vectors, the scalar form on the tail)
void silu_mul_f32_rows(const float* gu, float* out, int64_t rows, int64_t inner) {
  using V = at::vec::Vectorized<float>;
  const V one(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inner;
    const float* u = g + inner;
    float* o = out + r * inner;
    int64_t i = 0;
    for (; i + V::size() <= inner; i += V::size()) {
      const V x = V::loadu(g + i);
      ((x / (one + x.neg().exp())) * V::loadu(u + i)).store(o + i);
    }
    for (; i < inner; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
  }
}
void silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, PARALLEL_ROWS, [&](int64_t begin, int64_t end) {
    silu_mul_f32_rows(gu + begin * 2 * inner, out + begin * inner, end - begin, inner);
  });
}
void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t rows, int64_t inner) {
  silu_mul<c10::BFloat16>(gu, out, rows, inner);
}
}
"""

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# decode-sized inputs, run on one thread: the decode stack's rows (the per-layer path must run
# the same kernels); fp32 inputs of more rows (prefill) are split across ATen's threads, bf16
# ones stay on ATen's kernels (their scalar loops here are not vectorised)
MAX_ROWS = 64


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        for name in _NAMES.values():
            cpu_build.bind(
                lib, f"add_rms_norm_{name}", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
            )
            cpu_build.bind(lib, f"silu_mul_{name}", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    return lib


def supports(x: torch.Tensor) -> bool:
    """A 2-D CPU activation without autograd in a dtype the kernels have: fp32 of any row
    count, bf16 up to ``MAX_ROWS``."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and (x.shape[0] <= MAX_ROWS or x.dtype == torch.float32)
        and x.dtype in _NAMES
        and not x.requires_grad
        and _library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(res, norm)`` with ``res = x + delta`` (``x`` itself when ``delta`` is None) and
    ``norm = RMSNorm(res)`` in ``x``'s dtype; ``weight`` [d] is read in fp32."""
    lib = _library()
    assert lib is not None
    x = x.contiguous()
    rows, d = x.shape
    w = weight.float().contiguous()
    out = torch.empty_like(x)
    if delta is None:
        res, dptr = x, None
    else:
        delta = delta.to(x.dtype).contiguous()
        res, dptr = torch.empty_like(x), delta.data_ptr()
    getattr(lib, f"add_rms_norm_{_NAMES[x.dtype]}")(
        x.data_ptr(), dptr, w.data_ptr(), res.data_ptr(), out.data_ptr(), rows, d, eps
    )
    return res, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 I] = [gate | up]; returns [rows, I]."""
    lib = _library()
    assert lib is not None
    gu = gate_up.contiguous()
    rows, width = gu.shape
    out = torch.empty(rows, width // 2, dtype=gu.dtype)
    getattr(lib, f"silu_mul_{_NAMES[gu.dtype]}")(gu.data_ptr(), out.data_ptr(), rows, width // 2)
    return out
