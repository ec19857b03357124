// int8 K/V pool rows for the attention and cache-write kernels (kernels/kv_int8.py defines
// them): a row of n values is n int8 codes, then n / 32 fp32 scales. row_elems<T>(n) (a
// row's width in pool elements), head_scales<T>(row, n, first) (the scales of the values from
// `first` on; nullptr for other pool types), i8_load(p) (one Vectorized<float> of codes) and
// i8_store_row(row, x, n) (encode n values, bitwise kv_int8.encode).
#ifndef DEEPINFER_KERNELS_CPU_INT8_ROWS_H
#define DEEPINFER_KERNELS_CPU_INT8_ROWS_H

#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

constexpr int64_t I8_BLOCK = 32;
static_assert(at::vec::Vectorized<float>::size() <= I8_BLOCK, "a vector of values shares one scale");

template <typename T>
constexpr bool is_i8_v = std::is_same_v<T, int8_t>;

template <typename T>
inline int64_t row_elems(int64_t n) {
  if constexpr (is_i8_v<T>) return n + n / I8_BLOCK * 4;
  else return n;
}

// the scales of a row's values from `first` on (first a multiple of 32)
template <typename T>
inline const float* head_scales(const T* row, int64_t n, int64_t first) {
  if constexpr (is_i8_v<T>) return reinterpret_cast<const float*>(row + n) + first / I8_BLOCK;
  else return nullptr;
}

inline at::vec::Vectorized<float> i8_load(const int8_t* p) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// the row of n values x (n a multiple of 32): codes round(x / s), s = max|x| / 127, half to even
inline void i8_store_row(int8_t* row, const float* x, int64_t n) {
  float* scales = reinterpret_cast<float*>(row + n);
  for (int64_t b = 0; b < n; b += I8_BLOCK) {
    float amax = 0.f;
    for (int64_t i = b; i < b + I8_BLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = amax / 127.f;
    for (int64_t i = b; i < b + I8_BLOCK; ++i) {
      const float c = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
      row[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
    }
    scales[b / I8_BLOCK] = s;
  }
}

#endif  // DEEPINFER_KERNELS_CPU_INT8_ROWS_H
