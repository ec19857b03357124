// The lightning indexer's top-k entry choice; built and called by kernels/indexer_topk.py, and
// compiled into the step ops (step_ops.py).

#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

// Adds sum over NH heads of ReLU(q_h . k) * scale * w_h to total, for the V entries of kt
// (kt[d * V + lane]). One FMA chain over d per (head, entry), NH chains interleaved so the
// loop is bound by FMA throughput rather than one chain's latency; heads added in order.
template <int NH>
static inline at::vec::Vectorized<float> add_heads(at::vec::Vectorized<float> total, const float* q, const float* kt,
                                                   const float* w, int64_t D, float scale) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec dot[NH];
  for (int j = 0; j < NH; ++j) dot[j] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec kd = Vec::loadu(kt + d * V);
    for (int j = 0; j < NH; ++j) dot[j] = at::vec::fmadd(Vec(q[j * D + d]), kd, dot[j]);
  }
  for (int j = 0; j < NH; ++j) total = total + at::vec::maximum(dot[j], Vec(0.f)) * Vec(scale) * Vec(w[j]);
  return total;
}

// The key rows of one block of V entries, transposed into kt[d * V + lane]: a lane whose
// index is outside the pool (or past the row's E entries) holds zeros. rows: [V, D] scratch.
static void transpose_block(const float* keys, const int64_t* idx, int64_t n, int64_t D, int64_t N, float* rows,
                            float* kt) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const int64_t whole = D - D % V;
  for (int64_t l = 0; l < V; ++l) {
    const bool in_pool = l < n && idx[l] >= 0 && idx[l] < N;
    const float* src = keys + (in_pool ? idx[l] : 0) * D;
    float* dst = rows + l * D;
    if (in_pool) {
      int64_t d = 0;
      for (; d < whole; d += V) Vec::loadu(src + d).store(dst + d);
      for (; d < D; ++d) dst[d] = src[d];
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = 0.f;
    }
  }
  at::vec::transpose_mxn<float>(rows, D, kt, V, static_cast<int>(V), static_cast<int>(D));
}

// Asks for the key rows of the n entries at idx (those inside the pool) to be brought into
// the cache: the rows are scattered over the pool, so each block's copy otherwise waits on
// its loads (a 200-row decode step spent most of the kernel on them).
static inline void prefetch_rows(const float* keys, const int64_t* idx, int64_t n, int64_t D, int64_t N) {
  for (int64_t l = 0; l < n; ++l) {
    if (idx[l] < 0 || idx[l] >= N) continue;
    const char* row = reinterpret_cast<const char*>(keys + idx[l] * D);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(row + b);
  }
}

// One row t: scores of its E entries into s (-inf where not visible), then the min(K, E) best
// (score descending, column ascending) into out_rows / out_valid, and K - E padding columns
// where E < K (the row's first entry, or pool row 0 without any, never visible). Returns how many visible entries
// point outside the pool (their scores are -inf). kts [E / V blocks, D, V] holds the previous
// row's transposed blocks and cached [E] their indices: the rows of one sequence's prefill
// chunk see the same entries, so a block is transposed once per run of such rows.
static int64_t indexer_row(const float* q, const float* keys, const int64_t* idx, const bool* valid,
                           const float* w, int64_t H, int64_t D, int64_t E, int64_t N, int64_t K, float scale,
                           float* s, float* rows, float* kts, int64_t* cached, int64_t* order, int64_t* out_rows,
                           bool* out_valid) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t bad = 0;
  bool live[V];
  for (int64_t e0 = 0; e0 < E; e0 += V) {
    const int64_t n = std::min<int64_t>(V, E - e0);
    bool any = false, same = true;
    for (int64_t l = 0; l < n; ++l) {
      live[l] = valid[e0 + l] && idx[e0 + l] >= 0 && idx[e0 + l] < N;
      bad += valid[e0 + l] && !live[l];
      any |= live[l];
      same &= cached[e0 + l] == idx[e0 + l];
    }
    if (!any) {
      for (int64_t l = 0; l < n; ++l) s[e0 + l] = neg_inf;
      continue;
    }
    float* kt = kts + e0 * D;
    if (!same) {
      if (e0 + V < E) prefetch_rows(keys, idx + e0 + V, std::min<int64_t>(V, E - e0 - V), D, N);
      transpose_block(keys, idx + e0, n, D, N, rows, kt);
      for (int64_t l = 0; l < n; ++l) cached[e0 + l] = idx[e0 + l];
    }
    Vec total(0.f);
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) total = add_heads<8>(total, q + h * D, kt, w + h, D, scale);
    switch (H - h) {
      case 7: total = add_heads<7>(total, q + h * D, kt, w + h, D, scale); break;
      case 6: total = add_heads<6>(total, q + h * D, kt, w + h, D, scale); break;
      case 5: total = add_heads<5>(total, q + h * D, kt, w + h, D, scale); break;
      case 4: total = add_heads<4>(total, q + h * D, kt, w + h, D, scale); break;
      case 3: total = add_heads<3>(total, q + h * D, kt, w + h, D, scale); break;
      case 2: total = add_heads<2>(total, q + h * D, kt, w + h, D, scale); break;
      case 1: total = add_heads<1>(total, q + h * D, kt, w + h, D, scale); break;
      default: break;
    }
    float lanes[V];
    total.store(lanes);
    for (int64_t l = 0; l < n; ++l) s[e0 + l] = live[l] ? lanes[l] : neg_inf;
  }
  const int64_t k = std::min(K, E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order, order + k, order + E, [s](int64_t a, int64_t b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
  });
  for (int64_t j = 0; j < k; ++j) {
    out_rows[j] = idx[order[j]];
    out_valid[j] = valid[order[j]];
  }
  for (int64_t j = k; j < K; ++j) {
    out_rows[j] = E > 0 ? idx[0] : 0;
    out_valid[j] = false;
  }
  return bad;
}

// q [T, H, D], keys [N, D], entry_idx / entry_valid [T, E], weights [T, H]; out [T, K].
// Returns the count of visible entries outside the pool.
extern "C" int64_t indexer_topk_f32(const float* q, const float* keys, const int64_t* entry_idx,
                                    const bool* entry_valid, const float* weights, int64_t* out_rows,
                                    bool* out_valid, int64_t T, int64_t H, int64_t D, int64_t E, int64_t N,
                                    int64_t K, float scale, int threads) {
  constexpr int64_t V = at::vec::Vectorized<float>::size();
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad)
  {
    const int64_t blocks = (E + V - 1) / V;
    std::vector<float> s(E), rows(V * D), kts(blocks * V * D);
    std::vector<int64_t> order(E), cached(E, -1);  // -1: no block transposed yet (nor any index)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (t + 1 < T) prefetch_rows(keys, entry_idx + (t + 1) * E, std::min<int64_t>(V, E), D, N);
      bad += indexer_row(q + t * H * D, keys, entry_idx + t * E, entry_valid + t * E, weights + t * H, H, D, E,
                         N, K, scale, s.data(), rows.data(), kts.data(), cached.data(), order.data(),
                         out_rows + t * K, out_valid + t * K);
    }
  }
  return bad;
}
