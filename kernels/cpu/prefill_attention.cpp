// Causal prefill attention over the paged K/V pools; built and called by prefill_attention.py.

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
constexpr int MR = V >= 16 ? 12 : 6;    // rows per score tile
constexpr int ACC = V >= 16 ? 24 : 12;  // accumulator registers of a weighted-sum tile
constexpr float NINF = -std::numeric_limits<float>::infinity();

extern "C" int64_t prefill_attention_width() { return V; }

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// s[m][j] = scale * q_m . k_j for R rows and keys j < nk; kt: keys in blocks of V, [nkb][d][V]
template <int R>
inline void scores(const float* const* qr, const float* kt, float* s, int64_t stride, int64_t nk, int64_t d,
                   float scale) {
  const Vec sc(scale);
  for (int64_t jb = 0; jb * V < nk; ++jb) {
    Vec acc[R];
    for (int m = 0; m < R; ++m) acc[m] = Vec(0.f);
    const float* kb = kt + jb * d * V;
    for (int64_t c = 0; c < d; ++c) {
      const Vec kv = Vec::loadu(kb + c * V);
      for (int m = 0; m < R; ++m) acc[m] = at::vec::fmadd(kv, Vec(qr[m][c]), acc[m]);
    }
    for (int m = 0; m < R; ++m) (acc[m] * sc).store(s + m * stride + jb * V);
  }
}

template <int R>
inline void scores_tail(int r, const float* const* qr, const float* kt, float* s, int64_t stride, int64_t nk,
                        int64_t d, float scale) {
  if constexpr (R > 0) {
    if (r == R) scores<R>(qr, kt, s, stride, nk, d, scale);
    else scores_tail<R - 1>(r, qr, kt, s, stride, nk, d, scale);
  }
}

// o_m = inv_m * sum_j p[m][j] v_j for R rows, keys j < nk, over DV vectors of the head; vv: the
// block's first column, rows of d floats
template <int DV, int R>
inline void weighted(const float* p, int64_t stride, const float* vv, int64_t d, int64_t nk, float* const* orow,
                     const float* inv) {
  Vec acc[R][DV];
  for (int m = 0; m < R; ++m)
    for (int b = 0; b < DV; ++b) acc[m][b] = Vec(0.f);
  for (int64_t j = 0; j < nk; ++j) {
    Vec vj[DV];
    for (int b = 0; b < DV; ++b) vj[b] = Vec::loadu(vv + j * d + b * V);
    for (int m = 0; m < R; ++m) {
      const Vec w(p[m * stride + j]);
      for (int b = 0; b < DV; ++b) acc[m][b] = at::vec::fmadd(w, vj[b], acc[m][b]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int b = 0; b < DV; ++b) (acc[m][b] * Vec(inv[m])).store(orow[m] + b * V);
}

template <int DV, int R>
inline void weighted_block(int r, const float* p, int64_t stride, const float* vv, int64_t d, int64_t nk,
                           float* const* orow, const float* inv) {
  if constexpr (R > 0) {
    if (r == R) weighted<DV, R>(p, stride, vv, d, nk, orow, inv);
    else weighted_block<DV, R - 1>(r, p, stride, vv, d, nk, orow, inv);
  }
}

// rows of one item in tiles of ACC / DB rows by DB vectors of the head (DB = DV up to four
// vectors, else column blocks of four: a head of eight AVX2 vectors, d = 64, would leave one row
// per tile, every value load feeding a single FMA). Each output element still sums its keys in
// order, so the blocks change no bit.
template <int DV>
inline void weighted_rows(int rows, const float* p, int64_t stride, const float* vv, const int64_t* nk,
                          float* const* orow, const float* inv) {
  constexpr int DB = DV < 4 ? DV : 4;
  constexpr int R = ACC / DB;
  constexpr int64_t d = DV * V;
  float* cols[R];
  for (int m = 0; m < rows; m += R) {
    const int r = std::min(R, rows - m);
    int64_t n = 0;
    for (int i = 0; i < r; ++i) n = std::max(n, nk[m + i]);
    for (int b = 0; b < DV; b += DB) {
      for (int i = 0; i < r; ++i) cols[i] = orow[m + i] + b * V;
      weighted_block<DB, R>(r, p + m * stride, stride, vv + b * V, d, n, cols, inv + m);
    }
  }
}

// p[0, n) = exp(p - mx) with p[n, padded) = 0; returns the sum over [0, n)
inline float softmax_row(float* p, int64_t n, int64_t padded) {
  float mx = NINF;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  for (int64_t j = n; j < padded; ++j) p[j] = NINF;
  const Vec m(mx);
  Vec sv(0.f);
  for (int64_t j = 0; j < padded; j += V) {
    const Vec e = (Vec::loadu(p + j) - m).exp_u20();
    e.store(p + j);
    sv = sv + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sv);
}

// q [T, H, d] fp32; pools [rows, row_elems(n_kv * d)]; spans [S, 4] = (first token row, tokens, first
// position, offset into kv_rows); kv_rows: each span's pool rows of positions 0 .. end - 1;
// out [T, H, d] fp32 (span rows written). Token i of a span sees positions 0 .. start + i.
template <typename T>
void prefill_attention(const float* q, const T* kp, const T* vp, const int64_t* spans, const int64_t* kv_rows,
                       float* out, int64_t S, int64_t H, int64_t n_kv, int64_t d, float scale, int threads) {
  const int64_t G = H / n_kv, DV = d / V;
  const int64_t QB = std::max<int64_t>(1, MR / G);  // query positions per item
  std::vector<int64_t> kt_off(S + 1, 0), vv_off(S + 1, 0);
  struct Item { int64_t s, h, i0; };
  std::vector<Item> items;
  int64_t widest = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t count = spans[s * 4 + 1], end = spans[s * 4 + 2] + count;
    const int64_t nkb = count > 0 ? (end + V - 1) / V : 0;
    kt_off[s + 1] = kt_off[s] + n_kv * nkb * d * V;
    vv_off[s + 1] = vv_off[s] + (count > 0 ? n_kv * end * d : 0);
    widest = std::max(widest, nkb * V);
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t i0 = 0; i0 < count; i0 += QB) items.push_back({s, h, i0});
  }
  std::vector<float> kt(kt_off[S]), vv(vv_off[S]);
  // pack: per span, K/V head and block of V keys, the keys transposed (zero past the end) and
  // the values as rows of d, from the pool rows in place; blocks spread over the threads
  struct Block { int64_t s, h, jb; };
  std::vector<Block> blocks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t count = spans[s * 4 + 1], end = spans[s * 4 + 2] + count;
    if (count == 0) continue;
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t jb = 0; jb * V < end; ++jb) blocks.push_back({s, h, jb});
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    const Block blk = blocks[bi];
    const int64_t end = spans[blk.s * 4 + 2] + spans[blk.s * 4 + 1], nkb = (end + V - 1) / V;
    const int64_t* rows = kv_rows + spans[blk.s * 4 + 3];
    float* kb = kt.data() + kt_off[blk.s] + (blk.h * nkb + blk.jb) * d * V;
    float* vb = vv.data() + vv_off[blk.s] + blk.h * end * d;
    for (int64_t i = 0; i < V; ++i) {
      const int64_t j = blk.jb * V + i;
      if (j >= end) {
        for (int64_t c = 0; c < d; ++c) kb[c * V + i] = 0.f;
        continue;
      }
      const int64_t rw = row_elems<T>(n_kv * d);
      const T* kr = kp + rows[j] * rw + blk.h * d;
      const T* vr = vp + rows[j] * rw + blk.h * d;
      if constexpr (is_i8_v<T>) {  // codes times their block's scale
        const float* ks = head_scales<T>(kp + rows[j] * rw, n_kv * d, blk.h * d);
        const float* vs = head_scales<T>(vp + rows[j] * rw, n_kv * d, blk.h * d);
        for (int64_t c = 0; c < d; ++c) kb[c * V + i] = to_f(kr[c]) * ks[c / I8_BLOCK];
        for (int64_t c = 0; c < d; ++c) vb[j * d + c] = to_f(vr[c]) * vs[c / I8_BLOCK];
      } else {
        for (int64_t c = 0; c < d; ++c) kb[c * V + i] = to_f(kr[c]);
        for (int64_t c = 0; c < d; ++c) vb[j * d + c] = to_f(vr[c]);
      }
    }
  }
  const int64_t rows_max = std::max<int64_t>(QB * G, 1);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(rows_max * (widest + V));
    std::vector<const float*> qr(rows_max);
    std::vector<float*> orow(rows_max);
    std::vector<int64_t> nk(rows_max);
    std::vector<float> inv(rows_max);
#pragma omp for schedule(dynamic, 1)
    for (size_t it = 0; it < items.size(); ++it) {
      const Item item = items[it];
      const int64_t first = spans[item.s * 4], count = spans[item.s * 4 + 1], start = spans[item.s * 4 + 2];
      const int64_t end = start + count, nkb = (end + V - 1) / V, stride = nkb * V;
      const int64_t i1 = std::min(count, item.i0 + QB);
      int rows = 0;
      for (int64_t i = item.i0; i < i1; ++i)
        for (int64_t g = 0; g < G; ++g, ++rows) {
          const int64_t off = ((first + i) * H + item.h * G + g) * d;
          qr[rows] = q + off;
          orow[rows] = out + off;
          nk[rows] = start + i + 1;
        }
      const float* kb = kt.data() + kt_off[item.s] + item.h * nkb * d * V;
      const float* vb = vv.data() + vv_off[item.s] + item.h * end * d;
      for (int m = 0; m < rows; m += MR) {
        const int r = std::min<int>(MR, rows - m);
        scores_tail<MR>(r, qr.data() + m, kb, p.data() + m * stride, stride, nk[m + r - 1], d, scale);
      }
      for (int m = 0; m < rows; ++m) {
        const int64_t padded = (nk[m] + V - 1) / V * V;
        inv[m] = 1.f / softmax_row(p.data() + m * stride, nk[m], padded);
        for (int64_t j = padded; j < stride; ++j) p[m * stride + j] = 0.f;
      }
      switch (DV) {
        case 1: weighted_rows<1>(rows, p.data(), stride, vb, nk.data(), orow.data(), inv.data()); break;
        case 2: weighted_rows<2>(rows, p.data(), stride, vb, nk.data(), orow.data(), inv.data()); break;
        case 4: weighted_rows<4>(rows, p.data(), stride, vb, nk.data(), orow.data(), inv.data()); break;
        case 8: weighted_rows<8>(rows, p.data(), stride, vb, nk.data(), orow.data(), inv.data()); break;
      }
    }
  }
}

#define ENTRY(NAME, T)                                                                              \
  extern "C" void NAME(const float* q, const T* k, const T* v, const int64_t* spans, const int64_t* kv_rows, \
                       float* out, int64_t S, int64_t H, int64_t n_kv, int64_t d, float scale, int threads) { \
    prefill_attention<T>(q, k, v, spans, kv_rows, out, S, H, n_kv, d, scale, threads);                     \
  }
ENTRY(prefill_attention_f32, float)
ENTRY(prefill_attention_bf16, at::BFloat16)
ENTRY(prefill_attention_f16, at::Half)
ENTRY(prefill_attention_e4m3, c10::Float8_e4m3fn)
ENTRY(prefill_attention_e5m2, c10::Float8_e5m2)
ENTRY(prefill_attention_i8, int8_t)
