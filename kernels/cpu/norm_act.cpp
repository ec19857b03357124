// RMSNorm with its residual add, and SwiGLU; built and called by norm_act.py.

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
