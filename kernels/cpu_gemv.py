"""Small-batch fp32 CPU projections (``y = x @ W.T + b``) that stream the weights near memory bandwidth.

Decode at a few tokens per step reads every weight once per step, so a projection is as fast
as its weight bytes move. oneDNN's and MKL's fp32 GEMMs are built for large M; at M <= 8
they leave a third of the memory bandwidth unused on the CPUs measured, and this kernel stays
ahead of oneDNN's packed GEMM up to M = 16 (benchmarks/RESULTS.md).
At up to four activation rows each thread streams its share of weight rows linearly, one row
after the other, multiplying each with all the activation rows held in registers (20-35% more
bandwidth than eight interleaved rows on the CPU measured); from five rows on it keeps twelve
weight rows in flight with two activation rows per pass, so each load feeds more FMAs with
every accumulator in a register (~20% over eight rows x four). Output rows are split across
the OpenMP threads torch uses.
Weights stay in their row-major layout (the model's own parameters, no packed copy).
bf16 and int8 weight variants of the same loop measured slower than oneDNN's bf16 GEMM and
``torch._weight_int8pack_mm`` at every M from 1 to 8 (RESULTS.md), so only fp32 is here.

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
MAX_ROWS = 16

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

using Vec = at::vec::Vectorized<float>;

inline float hsum(const Vec& v) {
  alignas(64) float b[Vec::size()];
  v.store(b);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += b[i];
  return s;
}

// Vec::size() weights as fp32 (int8 widened exactly)
inline Vec load_w(const float* p) { return Vec::loadu(p); }
inline Vec load_w(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float b[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) b[i] = static_cast<float>(p[i]);
  return Vec::loadu(b);
#endif
}

// y[m, n0 + r] for r < R, m < MC: one fp32 accumulator per output, then the row's scale
// (int8 weights) and bias
template <typename W, int R, int MC>
inline void tile(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t N,
                 int64_t K, int64_t n0) {
  Vec acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = Vec(0.f);
  const W* wr = w + n0 * K;
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    Vec xv[MC];
    for (int m = 0; m < MC; ++m) xv[m] = Vec::loadu(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      Vec wv = load_w(wr + r * K + k);
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

template <typename W, int R, int MC>
inline void block(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t N,
                  int64_t K, int64_t n) {
  if (n + R <= N) {
    tile<W, R, MC>(x, w, scale, bias, y, N, K, n);
  } else {
    for (; n < N; ++n) tile<W, 1, MC>(x, w, scale, bias, y, N, K, n);
  }
}

// Passes of up to MC activation rows over each group of R weight rows.
template <typename W, int R, int MC>
void gemv(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t M, int64_t N,
          int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n += R) {
    for (int64_t m = 0; m < M; m += MC) {
      const float* xm = x + m * K;
      float* ym = y + m * N;
      const int64_t rows = std::min<int64_t>(MC, M - m);
      if (rows == 1) block<W, R, 1>(xm, w, scale, bias, ym, N, K, n);
      if constexpr (MC >= 2) if (rows == 2) block<W, R, 2>(xm, w, scale, bias, ym, N, K, n);
      if constexpr (MC >= 3) if (rows == 3) block<W, R, 3>(xm, w, scale, bias, ym, N, K, n);
      if constexpr (MC >= 4) if (rows == 4) block<W, R, 4>(xm, w, scale, bias, ym, N, K, n);
    }
  }
}

// Up to four activation rows: one pass, each thread reading its weight rows one after another
// (one linear stream, what the prefetchers follow best). Five or more: twelve weight rows in
// flight with two activation rows per pass (24 accumulators: all in registers). Every output
// is the same dot product either way (bitwise).
template <typename W>
void gemv_any(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t M,
              int64_t N, int64_t K, int threads) {
  if (M <= 4) {
    gemv<W, 1, 4>(x, w, scale, bias, y, M, N, K, threads);
  } else {
    gemv<W, 12, 2>(x, w, scale, bias, y, M, N, K, threads);
  }
}

extern "C" void gemv_f32(const float* x, const float* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, int threads) {
  gemv_any<float>(x, w, nullptr, bias, y, M, N, K, threads);
}

// int8 weights [N, K] with one fp32 scale per output row: y = scale * (x . w) + bias
extern "C" void gemv_i8(const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                        int64_t M, int64_t N, int64_t K, int threads) {
  gemv_any<int8_t>(x, w, scale, bias, y, M, N, K, threads);
}

constexpr int W4 = 32 / Vec::size();  // vectors per group of 32 int4 weights

// One group of 32 int4 weights as fp32 vectors w = q * s + c; byte j of the group holds q[j]
// (low nibble) and q[j + 16] (high nibble).
inline void int4_group(const uint8_t* b, float s, float c, Vec* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const Vec sv(s), cv(c);
  w[0] = at::vec::fmadd(Vec(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))), sv, cv);
  w[1] = at::vec::fmadd(Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), sv, cv);
#else
  alignas(64) float f[32];
  for (int j = 0; j < 16; ++j) {
    f[j] = std::fma(static_cast<float>(b[j] & 15), s, c);
    f[j + 16] = std::fma(static_cast<float>(b[j] >> 4), s, c);
  }
  for (int v = 0; v < W4; ++v) w[v] = Vec::loadu(f + v * Vec::size());
#endif
}

// y[m, n] for MC activation rows: each group dequantized once, in registers, for all MC rows
template <int MC>
inline void int4_row(const float* x, const uint8_t* wr, const float* sr, const float* cr, const float* bias,
                     float* y, int64_t N, int64_t K, int64_t n) {
  Vec acc[MC][W4];
  for (int m = 0; m < MC; ++m)
    for (int v = 0; v < W4; ++v) acc[m][v] = Vec(0.f);
  for (int64_t g = 0; g < K / 32; ++g) {
    Vec w[W4];
    int4_group(wr + g * 16, sr[g], cr[g], w);
    for (int m = 0; m < MC; ++m)
      for (int v = 0; v < W4; ++v)
        acc[m][v] = at::vec::fmadd(w[v], Vec::loadu(x + m * K + g * 32 + v * Vec::size()), acc[m][v]);
  }
  for (int m = 0; m < MC; ++m) {
    Vec a = acc[m][0];
    for (int v = 1; v < W4; ++v) a = a + acc[m][v];
    float r = hsum(a);
    if (bias) r += bias[n];
    y[m * N + n] = r;
  }
}

// int4 weights [N, K / 2] (groups of 32, fp32 scale s and offset c per group: w = q * s + c),
// up to four activation rows per pass, each thread reading its weight rows one after another
extern "C" void gemv_i4(const float* x, const uint8_t* w, const float* scale, const float* offset,
                        const float* bias, float* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t G = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wr = w + n * (K / 2);
    for (int64_t m = 0; m < M; m += 4) {
      const float* xm = x + m * K;
      float* ym = y + m * N;
      const float* sr = scale + n * G;
      const float* cr = offset + n * G;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: int4_row<1>(xm, wr, sr, cr, bias, ym, N, K, n); break;
        case 2: int4_row<2>(xm, wr, sr, cr, bias, ym, N, K, n); break;
        case 3: int4_row<3>(xm, wr, sr, cr, bias, ym, N, K, n); break;
        default: int4_row<4>(xm, wr, sr, cr, bias, ym, N, K, n); break;
      }
    }
  }
}
"""

ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
ARGTYPES_I8 = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
ARGTYPES_I4 = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (or load from Inductor's cache) the kernel; None where that fails."""
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        cpu_build.bind(lib, "gemv_f32", ARGTYPES)
        cpu_build.bind(lib, "gemv_i8", ARGTYPES_I8)
        cpu_build.bind(lib, "gemv_i4", ARGTYPES_I4)
    return lib


def available() -> bool:
    """Whether the kernel built on this machine (built on the first call)."""
    return _library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is what the kernel reads: a contiguous fp32 CPU matrix."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and available()
    )


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [M, K] (any float dtype; M <= ``MAX_ROWS`` for the
    speed this is for), ``weight`` [N, K] fp32, ``bias`` [N] or None. Returns fp32 [M, N]."""
    return _run(x, weight, None, bias)


def small_gemm_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x @ qweight.T) * scale + bias`` for int8 ``qweight`` [N, K] with fp32 ``scale`` [N]:
    fp32 activations and accumulation (the int8 values widen exactly). Returns fp32 [M, N]."""
    return _run(x, qweight, scale, bias)


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
    lib = _library()
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


def _run(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError("the small-batch CPU kernel did not build on this machine")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"small_gemm: x has {k} columns, weight {tuple(weight.shape)}")
    xf = x.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()  # kept alive across the call
    b = None if bf is None else bf.data_ptr()
    y = torch.empty(m, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if scale is None:
        lib.gemv_f32(xf.data_ptr(), weight.data_ptr(), b, y.data_ptr(), m, n, k, threads)
    else:
        lib.gemv_i8(xf.data_ptr(), weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), m, n, k, threads)
    return y
