"""Small-batch CPU projections (``y = x @ W.T``) that stream the weights at memory speed.

Decode at a few tokens per step reads every weight once per step, so a projection is as fast
as its weight bytes move. oneDNN's and MKL's fp32 GEMMs are built for large M; at M <= 8
they leave a third of the memory bandwidth unused on the CPUs measured (benchmarks/RESULTS.md).
This kernel keeps eight weight rows in flight per step of K, multiplies them with up to four
activation rows held in registers, and splits output rows across the OpenMP threads torch uses.
Weights stay in their row-major layout (the model's own parameters, no packed copy) as fp32,
bf16, or int8 with one fp32 scale per output row; activations and sums are fp32.

Built once per machine by ``cpu_build`` (Inductor's C++ driver and cache); where no compiler
works, ``available()`` is false and callers keep their GEMMs.

Each output element is one dot product in a fixed order that does not depend on M or on the
other rows, so a row's result is the same whatever it is batched with (batch-invariant up to
``MAX_ROWS``).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build

# Activation rows up to which the kernel beats oneDNN on the CPUs measured; above it the GEMM
# is compute-bound and the vendor libraries win.
MAX_ROWS = 8

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>

using Vec = at::vec::Vectorized<float>;
constexpr int ROWS = 8;  // weight rows in flight
constexpr int COLS = 4;  // activation rows per pass

template <typename W> inline Vec load_w(const W* p);
template <> inline Vec load_w<float>(const float* p) { return Vec::loadu(p); }
#if defined(CPU_CAPABILITY_AVX512)
template <> inline Vec load_w<at::BFloat16>(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
template <> inline Vec load_w<int8_t>(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
}
#elif defined(CPU_CAPABILITY_AVX2)
template <> inline Vec load_w<at::BFloat16>(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}
template <> inline Vec load_w<int8_t>(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
}
#else
template <> inline Vec load_w<at::BFloat16>(const at::BFloat16* p) {
  return at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(p, Vec::size()));
}
template <> inline Vec load_w<int8_t>(const int8_t* p) {
  return at::vec::convert<float>(at::vec::Vectorized<int8_t>::loadu(p, Vec::size()));
}
#endif

inline float hsum(const Vec& v) {
  alignas(64) float b[Vec::size()];
  v.store(b);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += b[i];
  return s;
}

// y[m, n0 + r] for r < R, m < MC
template <typename W, int R, int MC>
inline void tile(const float* x, const W* w, const float* scale, const float* bias, float* y,
                 int64_t N, int64_t K, int64_t n0) {
  Vec acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = Vec(0.f);
  const W* wr = w + n0 * K;
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    Vec xv[MC];
    for (int m = 0; m < MC; ++m) xv[m] = Vec::loadu(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      Vec wv = load_w<W>(wr + r * K + k);
      for (int m = 0; m < MC; ++m) acc[r][m] = at::vec::fmadd(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += static_cast<float>(wr[r * K + kk]) * x[m * K + kk];
      if (scale) s *= scale[n0 + r];
      if (bias) s += bias[n0 + r];
      y[m * N + n0 + r] = s;
    }
}

template <typename W, int MC>
inline void block(const float* x, const W* w, const float* scale, const float* bias, float* y,
                  int64_t N, int64_t K, int64_t n) {
  if (n + ROWS <= N) {
    tile<W, ROWS, MC>(x, w, scale, bias, y, N, K, n);
  } else {
    for (; n < N; ++n) tile<W, 1, MC>(x, w, scale, bias, y, N, K, n);
  }
}

template <typename W>
void gemv(const float* x, const W* w, const float* scale, const float* bias, float* y,
          int64_t M, int64_t N, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n += ROWS) {
    for (int64_t m = 0; m < M; m += COLS) {
      const float* xm = x + m * K;
      float* ym = y + m * N;
      switch (std::min<int64_t>(COLS, M - m)) {
        case 1: block<W, 1>(xm, w, scale, bias, ym, N, K, n); break;
        case 2: block<W, 2>(xm, w, scale, bias, ym, N, K, n); break;
        case 3: block<W, 3>(xm, w, scale, bias, ym, N, K, n); break;
        default: block<W, 4>(xm, w, scale, bias, ym, N, K, n); break;
      }
    }
  }
}

extern "C" {
void gemv_f32(const float* x, const float* w, const float* s, const float* b, float* y,
              int64_t M, int64_t N, int64_t K, int t) { gemv<float>(x, w, s, b, y, M, N, K, t); }
void gemv_bf16(const float* x, const at::BFloat16* w, const float* s, const float* b, float* y,
               int64_t M, int64_t N, int64_t K, int t) { gemv<at::BFloat16>(x, w, s, b, y, M, N, K, t); }
void gemv_i8(const float* x, const int8_t* w, const float* s, const float* b, float* y,
             int64_t M, int64_t N, int64_t K, int t) { gemv<int8_t>(x, w, s, b, y, M, N, K, t); }
}
"""

_ENTRY = {torch.float32: "gemv_f32", torch.bfloat16: "gemv_bf16", torch.int8: "gemv_i8"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (or load from Inductor's cache) the kernels; None where that fails."""
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        for name in _ENTRY.values():
            cpu_build.bind(lib, name, [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int])
    return lib


def available() -> bool:
    """Whether the kernels built on this machine (built on the first call)."""
    return _library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a layout the kernels read: a contiguous CPU fp32/bf16/int8 matrix."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _ENTRY
        and weight.is_contiguous()
        and available()
    )


def small_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x @ weight.T) * scale + bias`` for ``x`` [M, K] (any float dtype, M <= ``MAX_ROWS``
    for the speed this is for), ``weight`` [N, K] fp32/bf16/int8, ``scale``/``bias`` [N] or
    None. Returns fp32 [M, N]; the caller casts."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the small-batch CPU kernels did not build on this machine")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"small_gemm: x has {k} columns, weight {tuple(weight.shape)}")
    xf = x.float().contiguous()
    s = None if scale is None else scale.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    getattr(lib, _ENTRY[weight.dtype])(
        xf.data_ptr(),
        weight.data_ptr(),
        None if s is None else s.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y
