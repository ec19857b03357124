// Decode attention over the paged K/V pools, read in place; built and called by attention.py.

#include "fp8.h"
#include "int8_rows.h"
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr float NINF = -std::numeric_limits<float>::infinity();
constexpr int64_t AHEAD = 8;  // cached rows a score pass prefetches ahead (K and V)

template <typename T>
inline Vec load_f(const T* p) {  // V pool values as fp32 (bf16 / fp16 / fp8 widened, int8 codes)
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (is_i8_v<T>) {
    return i8_load(p);
  } else if constexpr (is_fp8_v<T>) {
    return fp8_load<T>(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// values j .. j + V of a head whose scales are sc (int8 rows; nullptr: none)
template <typename T>
inline Vec load_scaled(const T* p, const float* sc, int64_t j) {
  if constexpr (is_i8_v<T>) return load_f(p + j) * Vec(sc[j / I8_BLOCK]);
  else return load_f(p + j);
}

template <typename T>
inline float scaled_at(const T* p, const float* sc, int64_t j) {
  if constexpr (is_i8_v<T>) return static_cast<float>(p[j]) * sc[j / I8_BLOCK];
  else return static_cast<float>(p[j]);
}

inline float hsum(const Vec& a) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
}

// p[l] = exp(p[l] - mx) over n keys (masked keys hold -inf and become 0); returns the sum
inline float exp_sum(float* p, int64_t n, float mx) {
  const Vec m(mx);
  Vec sv(0.f);
  int64_t l = 0;
  for (; l + V <= n; l += V) {
    const Vec e = (Vec::loadu(p + l) - m).exp_u20();
    e.store(p + l);
    sv = sv + e;
  }
  float s = hsum(sv);
  for (; l < n; ++l) {
    p[l] = std::exp(p[l] - mx);
    s += p[l];
  }
  return s;
}

// GC query heads sharing K/V head g, head size DV vectors: queries and output accumulators held
// in registers, each cached K and V row read once for all GC heads.
template <typename T, int DV, int GC>
void heads_fixed(const float* qh, const T* k, const T* v, const int64_t* kvi, const bool* ok, int64_t L,
                 int64_t n_kv, int64_t g, float scale, float* p, int64_t stride, float* o) {
  constexpr int64_t d = DV * V;
  const int64_t rw = row_elems<T>(n_kv * d);
  Vec qv[GC][DV];
  for (int r = 0; r < GC; ++r)
    for (int j = 0; j < DV; ++j) qv[r][j] = Vec::loadu(qh + r * d + j * V);
  float mx[GC];
  for (int r = 0; r < GC; ++r) mx[r] = NINF;
  for (int64_t l = 0; l < L; ++l) {
    if (!ok[l]) {
      for (int r = 0; r < GC; ++r) p[r * stride + l] = NINF;
      continue;
    }
    const T* kr = k + kvi[l] * rw + g * d;
    const float* ks = head_scales<T>(k + kvi[l] * rw, n_kv * d, g * d);
    if (l + AHEAD < L) {  // the rows sit in scattered blocks: fetch ahead of the hardware
      const int64_t ahead = kvi[l + AHEAD] * rw + g * d;
      for (int64_t c = 0; c < d * int64_t(sizeof(T)); c += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + ahead) + c);
        __builtin_prefetch(reinterpret_cast<const char*>(v + ahead) + c);
      }
    }
    Vec kv[DV];
    for (int j = 0; j < DV; ++j) kv[j] = load_scaled(kr, ks, j * V);
    for (int r = 0; r < GC; ++r) {
      Vec a = qv[r][0] * kv[0];
      for (int j = 1; j < DV; ++j) a = at::vec::fmadd(qv[r][j], kv[j], a);
      const float s = hsum(a) * scale;
      p[r * stride + l] = s;
      mx[r] = std::max(mx[r], s);
    }
  }
  float sum[GC];
  for (int r = 0; r < GC; ++r) sum[r] = mx[r] == NINF ? 0.f : exp_sum(p + r * stride, L, mx[r]);
  Vec acc[GC][DV];
  for (int r = 0; r < GC; ++r)
    for (int j = 0; j < DV; ++j) acc[r][j] = Vec(0.f);
  for (int64_t l = 0; l < L; ++l) {
    if (!ok[l]) continue;
    const T* vr = v + kvi[l] * rw + g * d;
    const float* vs = head_scales<T>(v + kvi[l] * rw, n_kv * d, g * d);
    Vec vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load_scaled(vr, vs, j * V);
    for (int r = 0; r < GC; ++r) {
      const Vec w(p[r * stride + l]);
      for (int j = 0; j < DV; ++j) acc[r][j] = at::vec::fmadd(w, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < GC; ++r) {  // nothing visible: zeros
    const Vec inv(mx[r] == NINF ? 0.f : 1.f / sum[r]);
    for (int j = 0; j < DV; ++j) (acc[r][j] * inv).store(o + r * d + j * V);
  }
}

// the registers hold at most 24 accumulator vectors: GC * DV <= 24
template <typename T, int DV>
void heads_dispatch(int64_t gc, const float* qh, const T* k, const T* v, const int64_t* kvi, const bool* ok,
                    int64_t L, int64_t n_kv, int64_t g, float scale, float* p, int64_t stride, float* o) {
  switch (gc) {
#define DEEPINFER_CASE(C) \
  case C:                 \
    if constexpr (C * DV <= 24) heads_fixed<T, DV, C>(qh, k, v, kvi, ok, L, n_kv, g, scale, p, stride, o); \
    break;
    DEEPINFER_CASE(1) DEEPINFER_CASE(2) DEEPINFER_CASE(3) DEEPINFER_CASE(4)
    DEEPINFER_CASE(5) DEEPINFER_CASE(6) DEEPINFER_CASE(7) DEEPINFER_CASE(8)
#undef DEEPINFER_CASE
  }
}

// Any head size: one query head at a time, accumulators in memory.
template <typename T>
void head_any(const float* qh, const T* k, const T* v, const int64_t* kvi, const bool* ok, int64_t L,
              int64_t n_kv, int64_t g, int64_t d, float scale, float* p, float* acc, float* o) {
  const int64_t dv = d / V * V, rw = row_elems<T>(n_kv * d);
  float mx = NINF;
  for (int64_t l = 0; l < L; ++l) {
    if (!ok[l]) {
      p[l] = NINF;
      continue;
    }
    const T* kr = k + kvi[l] * rw + g * d;
    const float* ks = head_scales<T>(k + kvi[l] * rw, n_kv * d, g * d);
    Vec a(0.f);
    for (int64_t j = 0; j < dv; j += V) a = at::vec::fmadd(Vec::loadu(qh + j), load_scaled(kr, ks, j), a);
    float s = hsum(a);
    for (int64_t j = dv; j < d; ++j) s += qh[j] * scaled_at(kr, ks, j);
    p[l] = s * scale;
    mx = std::max(mx, p[l]);
  }
  if (mx == NINF) {
    for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
    return;
  }
  const float inv = 1.f / exp_sum(p, L, mx);
  std::fill(acc, acc + d, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    if (!ok[l]) continue;
    const T* vr = v + kvi[l] * rw + g * d;
    const float* vs = head_scales<T>(v + kvi[l] * rw, n_kv * d, g * d);
    for (int64_t j = 0; j < dv; j += V)
      at::vec::fmadd(Vec(p[l]), load_scaled(vr, vs, j), Vec::loadu(acc + j)).store(acc + j);
    for (int64_t j = dv; j < d; ++j) acc[j] += p[l] * scaled_at(vr, vs, j);
  }
  for (int64_t j = 0; j < d; ++j) o[j] = acc[j] * inv;
}

// q, out [T, H, d] fp32; pools [rows, row_elems(n_kv * d)]; rows [n] (-1: padding); kv, valid [n, L].
// One work item per (decode row, K/V head); its query heads are done together.
template <typename T>
void decode_attention(const float* q, const T* k, const T* v, const int64_t* rows, const int64_t* kv,
                      const bool* valid, float* out, int64_t n, int64_t L, int64_t H, int64_t n_kv,
                      int64_t d, float scale, int threads) {
  const int64_t group = H / n_kv;
  const int64_t DV = d % V == 0 ? d / V : 0;
  const bool fixed = DV == 2 || DV == 4 || DV == 8 || DV == 16;
  const int64_t cap = fixed ? std::min<int64_t>(8, 24 / DV) : 1;
  const int64_t stride = L + V;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(cap * stride);
    std::vector<float> acc(d);
#pragma omp for collapse(2) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < n_kv; ++g) {
        const int64_t row = rows[i];
        if (row < 0) continue;
        const int64_t* kvi = kv + i * L;
        const bool* ok = valid + i * L;
        for (int64_t r0 = 0; r0 < group; r0 += cap) {
          const int64_t gc = std::min(cap, group - r0);
          const float* qh = q + (row * H + g * group + r0) * d;
          float* o = out + (row * H + g * group + r0) * d;
          float* pp = p.data();
          if (DV == 2) heads_dispatch<T, 2>(gc, qh, k, v, kvi, ok, L, n_kv, g, scale, pp, stride, o);
          else if (DV == 4) heads_dispatch<T, 4>(gc, qh, k, v, kvi, ok, L, n_kv, g, scale, pp, stride, o);
          else if (DV == 8) heads_dispatch<T, 8>(gc, qh, k, v, kvi, ok, L, n_kv, g, scale, pp, stride, o);
          else if (DV == 16) heads_dispatch<T, 16>(gc, qh, k, v, kvi, ok, L, n_kv, g, scale, pp, stride, o);
          else head_any<T>(qh, k, v, kvi, ok, L, n_kv, g, d, scale, pp, acc.data(), o);
        }
      }
    }
  }
}

#define ENTRY(NAME, T)                                                                                \
  extern "C" void NAME(const float* q, const T* k, const T* v, const int64_t* rows, const int64_t* kv,  \
                       const bool* valid, float* out, int64_t n, int64_t L, int64_t H, int64_t n_kv,      \
                       int64_t d, float scale, int threads) {                                             \
    decode_attention<T>(q, k, v, rows, kv, valid, out, n, L, H, n_kv, d, scale, threads);                \
  }
ENTRY(decode_attention_f32, float)
ENTRY(decode_attention_bf16, at::BFloat16)
ENTRY(decode_attention_f16, at::Half)
ENTRY(decode_attention_e4m3, c10::Float8_e4m3fn)
ENTRY(decode_attention_e5m2, c10::Float8_e5m2)
ENTRY(decode_attention_i8, int8_t)
