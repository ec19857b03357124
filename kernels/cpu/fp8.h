// fp8 K/V pool rows for the attention and cache-write kernels (fp8.py says how): is_fp8_v<T>,
// fp8_load<T>(p) (one Vectorized<float> of codes) and to_pool<P>(float) (a value as a pool
// element, fp8 saturated).
#ifndef DEEPINFER_KERNELS_CPU_FP8_H
#define DEEPINFER_KERNELS_CPU_FP8_H

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cstdint>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

template <typename T>
constexpr bool is_fp8_v = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// fp16 bits of the codes' values (e4m3fn: times 2^-8), from codes widened to 16-bit lanes
#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
inline __m256i fp8_half_bits(__m256i w) {
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return _mm256_slli_epi16(w, 8);
  } else {
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
    const __m256i bits = _mm256_or_si256(sign, _mm256_slli_epi16(mag, 7));
    return _mm256_blendv_epi8(bits, _mm256_or_si256(sign, _mm256_set1_epi16(0x7E00)), nan);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
template <typename T>
inline __m128i fp8_half_bits(__m128i w) {
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return _mm_slli_epi16(w, 8);
  } else {
    const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
    const __m128i bits = _mm_or_si128(sign, _mm_slli_epi16(mag, 7));
    return _mm_blendv_epi8(bits, _mm_or_si128(sign, _mm_set1_epi16(0x7E00)), nan);
  }
}
#endif

// one vector of fp32 values from as many fp8 codes
template <typename T>
inline at::vec::Vectorized<float> fp8_load(const T* p) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 f = _mm512_cvtph_ps(fp8_half_bits<T>(w));
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) return Vec(f);
  else return Vec(_mm512_mul_ps(f, _mm512_set1_ps(256.f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 f = _mm256_cvtph_ps(fp8_half_bits<T>(w));
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) return Vec(f);
  else return Vec(_mm256_mul_ps(f, _mm256_set1_ps(256.f)));
#else
  float tmp[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// a value as a pool element: fp8 saturated at its largest finite value (NaN stays NaN)
template <typename P>
inline P to_pool(float x) {
  if constexpr (is_fp8_v<P>) {
    constexpr float top = std::is_same_v<P, c10::Float8_e4m3fn> ? 448.f : 57344.f;
    x = x > top ? top : (x < -top ? -top : x);
  }
  return static_cast<P>(x);
}

#endif  // DEEPINFER_KERNELS_CPU_FP8_H
