// The attention core reading its keys from the cache pools by row (kernels/sink_attention_rows.py
// holds the formula); compiled into the step ops (step_ops.py).

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <omp.h>
#include <vector>

namespace {

constexpr int64_t kKeyRowsAhead = 4;  // rows whose key rows are prefetched ahead of the one computed

// Each 64-byte line of the visible key rows of row t (entries in [0, n) only: a bad index is
// counted where the row is computed, never touched).
inline void prefetch_key_rows(const float* pool, const int64_t* idx, const bool* vis, int64_t l, int64_t d,
                              int64_t n) {
  for (int64_t j = 0; j < l; ++j) {
    const int64_t r = idx[j];
    if (!vis[j] || r < 0 || r >= n) continue;
    const char* p = reinterpret_cast<const char*>(pool + r * d);
    for (int64_t b = 0; b < d * int64_t(sizeof(float)); b += 64) __builtin_prefetch(p + b, 0, 3);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The four horizontal sums of a0..a3 in one vector's first four lanes (a transposing
// reduction: ~10 instructions for four dot products instead of ~8 each).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(w);
}
#endif

// s[h * lp + j] = scale * q_h . kv for heads [0, H) of one key row.
inline void score_key(const float* qt, const float* kv, int64_t H, int64_t D, int64_t lp, int64_t j, float scale,
                      float* s) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  int64_t h = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; h + 4 <= H; h += 4) {  // four heads against each load of the key row
    const float* q0 = qt + h * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      const __m512 k = _mm512_loadu_ps(kv + c);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + c), k, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + D + c), k, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * D + c), k, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 3 * D + c), k, a3);
    }
    alignas(16) float dots[4];
    _mm_store_ps(dots, sum4(a0, a1, a2, a3));
    for (int64_t i = 0; i < 4; ++i) {
      float dot = dots[i];
      for (int64_t e = c; e < D; ++e) dot += q0[i * D + e] * kv[e];
      s[(h + i) * lp + j] = dot * scale;
    }
  }
#endif
  for (; h < H; ++h) {
    const float* qh = qt + h * D;
    Vec sum(0.f);
    int64_t c = 0;
    for (; c + V <= D; c += V) sum = at::vec::fmadd(Vec::loadu(qh + c), Vec::loadu(kv + c), sum);
    float dot = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, sum);
    for (; c < D; ++c) dot += qh[c] * kv[c];
    s[h * lp + j] = dot * scale;
  }
}

// Interleaved RoPE of the last 2 * half channels of each of h rows of d (in place): out[2i] =
// e c - o s, out[2i + 1] = o c + e s, each product rounded as written (the build has no FP
// contraction), so the bits are ``rope_cpu``'s and the Python formula's.
inline void rope_rows(float* x, int64_t h, int64_t d, const float* c, const float* s, int64_t half) {
  for (int64_t r = 0; r < h; ++r) {
    float* p = x + r * d + (d - 2 * half);
    for (int64_t i = 0; i < half; ++i) {
      const float e = p[2 * i], o = p[2 * i + 1];
      p[2 * i] = e * c[i] - o * s[i];
      p[2 * i + 1] = o * c[i] + e * s[i];
    }
  }
}

// out[0, D) = inv * sum_j p[j] * rows[j] over the rows present, in register blocks of four
// vectors across all rows, then single vectors, then the scalar tail.
inline void weighted_sum(const float* const* rows, const float* p, int64_t L, int64_t D, float inv, float* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  int64_t c = 0;
  for (; c + 4 * V <= D; c += 4 * V) {
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t j = 0; j < L; ++j) {
      const float* kv = rows[j];
      if (kv == nullptr) continue;
      const Vec w(p[j]);
      a0 = at::vec::fmadd(w, Vec::loadu(kv + c), a0);
      a1 = at::vec::fmadd(w, Vec::loadu(kv + c + V), a1);
      a2 = at::vec::fmadd(w, Vec::loadu(kv + c + 2 * V), a2);
      a3 = at::vec::fmadd(w, Vec::loadu(kv + c + 3 * V), a3);
    }
    (a0 * Vec(inv)).store(out + c);
    (a1 * Vec(inv)).store(out + c + V);
    (a2 * Vec(inv)).store(out + c + 2 * V);
    (a3 * Vec(inv)).store(out + c + 3 * V);
  }
  for (; c + V <= D; c += V) {
    Vec a(0.f);
    for (int64_t j = 0; j < L; ++j)
      if (rows[j] != nullptr) a = at::vec::fmadd(Vec(p[j]), Vec::loadu(rows[j] + c), a);
    (a * Vec(inv)).store(out + c);
  }
  for (; c < D; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < L; ++j)
      if (rows[j] != nullptr) a += p[j] * rows[j][c];
    out[c] = a * inv;
  }
}

}  // namespace

// q [T, H, D]; part p: pool_p [N_p, D], idx_p / vis_p [T, L_p] (l1 = 0: one part); sink [H];
// out [T, H, D]. qcos / qsin [T, qhalf] (qhalf = 0: none) rotate each row's queries first,
// ocos / osin [T, ohalf] its output. Returns the count of visible keys whose row lies outside
// their pool (those keys are skipped).
extern "C" int64_t sink_attention_rows_f32(const float* q, const float* pool0, const int64_t* idx0, const bool* vis0,
                                           int64_t n0, int64_t l0, const float* pool1, const int64_t* idx1,
                                           const bool* vis1, int64_t n1, int64_t l1, const float* sink, float* out,
                                           int64_t T, int64_t H, int64_t D, float scale, const float* qcos,
                                           const float* qsin, int64_t qhalf, const float* ocos, const float* osin,
                                           int64_t ohalf, int threads) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const int64_t L = l0 + l1, LP = (L + V - 1) / V * V;  // a head's scores, padded to whole vectors
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto prefetch = [&](int64_t t) {
    prefetch_key_rows(pool0, idx0 + t * l0, vis0 + t * l0, l0, D, n0);
    if (l1) prefetch_key_rows(pool1, idx1 + t * l1, vis1 + t * l1, l1, D, n1);
  };
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad)
  {
    std::vector<float> s(H * LP), qbuf(qhalf ? H * D : 0);
    std::vector<const float*> rows(L);
    bool first = true;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (first) {  // this thread's first row: the rows ahead of it too
        for (int64_t a = t + 1; a < std::min(T, t + kKeyRowsAhead); ++a) prefetch(a);
        first = false;
      }
      if (t + kKeyRowsAhead < T) prefetch(t + kKeyRowsAhead);
      for (int64_t j = 0; j < L; ++j) {
        const bool in0 = j < l0;
        const int64_t k = in0 ? t * l0 + j : t * l1 + (j - l0);
        const int64_t r = in0 ? idx0[k] : idx1[k], n = in0 ? n0 : n1;
        rows[j] = nullptr;
        if (!(in0 ? vis0[k] : vis1[k])) continue;
        if (r < 0 || r >= n) {
          ++bad;
          continue;
        }
        rows[j] = (in0 ? pool0 : pool1) + r * D;
      }
      const float* qt = q + t * H * D;
      if (qhalf) {  // this row's queries rotated into a buffer
        std::copy_n(qt, H * D, qbuf.data());
        rope_rows(qbuf.data(), H, D, qcos + t * qhalf, qsin + t * qhalf, qhalf);
        qt = qbuf.data();
      }
      std::fill(s.begin(), s.end(), neg_inf);
      for (int64_t j = 0; j < L; ++j)  // scores: each key row loaded once for four heads
        if (rows[j] != nullptr) score_key(qt, rows[j], H, D, LP, j, scale, s.data());
      float* ot = out + t * H * D;
      for (int64_t h = 0; h < H; ++h) {  // softmax over the keys and the sink, as vectors
        float* sh = s.data() + h * LP;
        Vec vmax(sink[h]);
        for (int64_t j = 0; j < LP; j += V) vmax = at::vec::maximum(vmax, Vec::loadu(sh + j));
        const float m =
            at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vmax);
        Vec vsum(0.f);
        for (int64_t j = 0; j < LP; j += V) {
          const Vec p = (Vec::loadu(sh + j) - Vec(m)).exp();
          p.store(sh + j);
          vsum = vsum + p;
        }
        const float denom = std::exp(sink[h] - m) +
                            at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, vsum);
        weighted_sum(rows.data(), sh, L, D, 1.f / denom, ot + h * D);
      }
      if (ohalf) rope_rows(ot, H, D, ocos + t * ohalf, osin + t * ohalf, ohalf);
    }
  }
  return bad;
}
