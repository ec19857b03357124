// Routed experts on the CPU (transposed and per-pair kernels); built and called by moe.py, and
// compiled into the step ops (step_ops.py).

#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

using Vec = at::vec::Vectorized<float>;

static inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  alignas(64) float lanes[Vec::size()];
  acc.store(lanes);
  float s = 0.f;
  for (int j = 0; j < Vec::size(); ++j) s += lanes[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// h[i] = silu(min(g, limit)) * clamp(u, -limit, limit) for gate g = gu[i], up u = gu[inter + i],
// in vectors (the exponential is at::vec's, as eager PyTorch's silu uses); a lane's result
// depends only on its own inputs, so not on the batch.
static inline void swiglu(const float* gu, int64_t inter, float limit, float* h) {
  const Vec hi(limit), lo(-limit), one(1.f);
  for (int64_t i = 0; i < inter; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), inter - i);
    const Vec g = at::vec::minimum(Vec::loadu(gu + i, n), hi);
    const Vec u = at::vec::clamp(Vec::loadu(gu + inter + i, n), lo, hi);
    (g / (one + g.neg().exp()) * u).store(h + i, n);
  }
}

// y[t][j] = sum_c x[t][c] * w[c * ld + j] for TB rows x[t] (row stride xs) and the NV vectors of
// columns at y[t] (row stride ys), the NV * TB accumulators in registers: each weight vector is
// loaded once for the TB rows, and every (row, column) sum is one FMA chain over ascending c
// (what repeated y += x[c] * w[c] does), whatever TB and NV are.
template <int NV, int TB>
static inline void block_times_block(const float* x, int64_t xs, const float* w, int64_t rows, int64_t ld,
                                     float* y, int64_t ys) {
  Vec acc[TB][NV];
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = Vec(0.f);
  for (int64_t c = 0; c < rows; ++c) {
    const float* wr = w + c * ld;
    Vec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Vec::loadu(wr + v * Vec::size());
    for (int t = 0; t < TB; ++t) {
      const Vec xv(x[t * xs + c]);
      for (int v = 0; v < NV; ++v) acc[t][v] = at::vec::fmadd(xv, wv[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v].store(y + t * ys + v * Vec::size());
}

// y [TB, cols] = x [TB, rows] times the row-major rows x cols matrix w (row strides xs, ys): column
// blocks of 4 vectors (of 2 above 4 rows: TB * NV accumulators within the 32 vector registers),
// then of 1, then scalar columns, each column summed in ascending row order with FMAs.
template <int TB>
static inline void block_times_matrix(const float* x, int64_t xs, const float* w, int64_t rows, int64_t cols,
                                      float* y, int64_t ys) {
  constexpr int NW = TB > 4 ? 2 : 4;
  constexpr int64_t wide = NW * Vec::size();
  int64_t j = 0;
  for (; j + wide <= cols; j += wide) block_times_block<NW, TB>(x, xs, w + j, rows, cols, y + j, ys);
  for (; j + Vec::size() <= cols; j += Vec::size()) block_times_block<1, TB>(x, xs, w + j, rows, cols, y + j, ys);
  for (; j < cols; ++j)
    for (int t = 0; t < TB; ++t) {
      float acc = 0.f;
      for (int64_t c = 0; c < rows; ++c) acc = std::fma(x[t * xs + c], w[c * cols + j], acc);
      y[t * ys + j] = acc;
    }
}

// One expert's SwiGLU on TB of its pairs: their token rows gathered into xb [TB, d], results
// into ys [TB, d] (gu [TB, 2I] and h [TB, I] scratch).
template <int TB>
static void expert_block(const float* xb, const float* w13, const float* w2, int64_t d, int64_t inter, float limit,
                         float* gu, float* h, float* ys) {
  block_times_matrix<TB>(xb, d, w13, d, 2 * inter, gu, 2 * inter);
  for (int t = 0; t < TB; ++t) swiglu(gu + t * 2 * inter, inter, limit, h + t * inter);
  block_times_matrix<TB>(h, inter, w2, inter, d, ys, d);
}

// Small experts, any token count: each pair's SwiGLU as rows times the transposed weights
// (w13t [E, d, 2I] = gate | up columns, w2t [E, I, d]), so every step is a vector FMA over
// the output columns and no dot product needs a horizontal sum. The pairs are grouped by
// expert and run PAIRS_PER_BLOCK at a time, so each weight vector loaded serves that many
// tokens (one token's pairs draw random experts, whose weights then come from L2 for every
// FMA); blocks split across threads. Each (pair, column) sum is one FMA chain over the input
// in ascending order, and each token's output sums its choices in choice order, so a token's
// result depends only on its own row, not on the batch or the grouping.
constexpr int PAIRS_PER_BLOCK = 8;

extern "C" void routed_experts_small_f32(const float* x, const float* weights, const int64_t* ids,
                                         const float* w13t, const float* w2t, float* out, int64_t n_tok,
                                         int64_t k, int64_t d, int64_t inter, float limit, int threads) {
  const int64_t pairs = n_tok * k;
  int64_t experts = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    if (ids[p] < 0) {  // no router gives one; NaN rows say so instead of writing out of bounds
      std::fill(out, out + n_tok * d, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    experts = std::max(experts, ids[p] + 1);
  }
  std::vector<int64_t> start(experts + 1, 0), order(pairs), blocks;
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[fill[ids[p]]++] = p;  // by expert, then pair order
  }
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t b = start[e]; b < start[e + 1]; b += PAIRS_PER_BLOCK) blocks.push_back(b);
  std::unique_ptr<float[]> y(new float[pairs * d]);  // each pair's expert output (all written)
  const int64_t n_blocks = static_cast<int64_t>(blocks.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> xb(PAIRS_PER_BLOCK * d), gu(PAIRS_PER_BLOCK * 2 * inter), h(PAIRS_PER_BLOCK * inter),
        yb(PAIRS_PER_BLOCK * d);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_blocks; ++i) {
      const int64_t b = blocks[i], e = ids[order[b]];
      const int64_t count = std::min<int64_t>(PAIRS_PER_BLOCK, start[e + 1] - b);
      for (int64_t t = 0; t < count; ++t) std::copy_n(x + (order[b + t] / k) * d, d, xb.data() + t * d);
      const float* w13 = w13t + e * d * 2 * inter;
      const float* w2 = w2t + e * inter * d;
      switch (count) {
        case 8: expert_block<8>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 7: expert_block<7>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 6: expert_block<6>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 5: expert_block<5>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 4: expert_block<4>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 3: expert_block<3>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        case 2: expert_block<2>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
        default: expert_block<1>(xb.data(), w13, w2, d, inter, limit, gu.data(), h.data(), yb.data()); break;
      }
      for (int64_t t = 0; t < count; ++t) std::copy_n(yb.data() + t * d, d, y.get() + order[b + t] * d);
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_tok; ++n) {
      float* o = out + n * d;
      for (int64_t c = 0; c < d; ++c) o[c] = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const float wt = weights[n * k + j];
        const float* yr = y.get() + (n * k + j) * d;
        for (int64_t c = 0; c < d; ++c) o[c] += wt * yr[c];
      }
    }
  }
}

// x [N, d], weights/ids [N, k], w1/w3 [E, I, d], w2 [E, d, I], scratch [N * k, 3I] (each pair's
// gate | up dot products, then its activations), out [N, d]
extern "C" void routed_experts_f32(const float* x, const float* weights, const int64_t* ids, const float* w1,
                                   const float* w2, const float* w3, float* scratch, float* out, int64_t n_tok,
                                   int64_t k, int64_t d, int64_t inter, float limit, int threads) {
  const int64_t pairs = n_tok * k;
  float* h = scratch + pairs * 2 * inter;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs * inter; ++q) {
      const int64_t p = q / inter, i = q % inter;
      const int64_t row = ids[p] * inter + i;
      const float* xr = x + (p / k) * d;
      scratch[p * 2 * inter + i] = dot(w1 + row * d, xr, d);
      scratch[p * 2 * inter + inter + i] = dot(w3 + row * d, xr, d);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) swiglu(scratch + p * 2 * inter, inter, limit, h + p * inter);
#pragma omp for schedule(static)
    for (int64_t q = 0; q < n_tok * d; ++q) {
      const int64_t n = q / d, o = q % d;
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = n * k + j;
        acc += weights[p] * dot(w2 + (ids[p] * d + o) * inter, h + p * inter, inter);
      }
      out[q] = acc;
    }
  }
}
