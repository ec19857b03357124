// int4 weights widened to fp32 in registers at a few rows; built and called by gemv.py.

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
