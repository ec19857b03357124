// Sinkhorn normalisation of the mHC stream mixer; built and called by kernels/sinkhorn.py, and
// compiled into the step ops (step_ops.py). SINKHORN_BLOCK and SINKHORN_THREADED_COUNT come from
// Python as -D flags (sinkhorn.DEFINES).

#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

using Vec = at::vec::Vectorized<float>;

// Column sums, then divide: c[i][j] /= (sum_i c[i][j] + eps).
static void normalise_columns(float* c, int64_t n, float eps, float* sums) {
  for (int64_t j = 0; j < n; ++j) sums[j] = 0.f;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) sums[j] += c[i * n + j];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sums[j] + eps;
}

static void normalise_rows(float* c, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) s += c[i * n + j];
    for (int64_t j = 0; j < n; ++j) c[i * n + j] /= s + eps;
  }
}

// Softmax of each row of one n x n matrix, then + eps (into c).
static void softmax_rows(const float* x, float* c, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float mx = x[i * n];
    for (int64_t j = 1; j < n; ++j) mx = std::fmax(mx, x[i * n + j]);
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      c[i * n + j] = std::exp(x[i * n + j] - mx);
      s += c[i * n + j];
    }
    for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / s + eps;
  }
}

// Any n: one matrix at a time.
static void sinkhorn_any(const float* logits, float* out, int64_t count, int64_t n, int64_t iters, float eps) {
  std::vector<float> sums(n);
  for (int64_t m = 0; m < count; ++m) {
    float* c = out + m * n * n;
    softmax_rows(logits + m * n * n, c, n, eps);
    normalise_columns(c, n, eps, sums.data());
    for (int64_t it = 1; it < iters; ++it) {
      normalise_rows(c, n, eps);
      normalise_columns(c, n, eps, sums.data());
    }
  }
}

// n = N known at compile time: B matrices side by side (element (i, j) of matrix b at
// c[i][j][b]), so the softmax and every sum and normalisation run across the B matrices as
// vector operations (at::vec, whatever the vector width). Each normalisation takes one
// reciprocal per row or column and multiplies by it: a vector division costs several
// multiplications, and there are N of them per N * N elements (the reciprocals halved the
// kernel's time). A matrix's arithmetic never depends on the lanes beside it, so a row's
// result does not depend on its batch, nor on the thread count.
template <int N>
static void sinkhorn_block(const float* logits, float* out, int64_t m0, int nb, int64_t iters, float eps) {
  constexpr int B = SINKHORN_BLOCK;
  constexpr int V = Vec::size();
  static_assert(B % V == 0, "whole vectors of matrices");
  alignas(64) float c[N][N][B];
  const Vec veps(eps), one(1.f);
  for (int b = 0; b < B; ++b)  // idle lanes: zeros, finite throughout, never stored
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) c[i][j][b] = b < nb ? logits[(m0 + b) * N * N + i * N + j] : 0.f;
  for (int b = 0; b < B; b += V) {
    for (int i = 0; i < N; ++i) {  // softmax of each row, then + eps
      Vec mx = Vec::loadu(&c[i][0][b]);
      for (int j = 1; j < N; ++j) mx = at::vec::maximum(mx, Vec::loadu(&c[i][j][b]));
      Vec e[N];
      Vec s(0.f);
      for (int j = 0; j < N; ++j) {
        e[j] = (Vec::loadu(&c[i][j][b]) - mx).exp();
        s = s + e[j];
      }
      const Vec r = one / s;
      for (int j = 0; j < N; ++j) (e[j] * r + veps).store(&c[i][j][b]);
    }
    for (int64_t it = 0; it < iters || it == 0; ++it) {
      if (it > 0) {
        for (int i = 0; i < N; ++i) {  // rows
          Vec s(0.f);
          for (int j = 0; j < N; ++j) s = s + Vec::loadu(&c[i][j][b]);
          const Vec r = one / (s + veps);
          for (int j = 0; j < N; ++j) (Vec::loadu(&c[i][j][b]) * r).store(&c[i][j][b]);
        }
      }
      Vec r[N];  // columns
      for (int j = 0; j < N; ++j) r[j] = Vec(0.f);
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) r[j] = r[j] + Vec::loadu(&c[i][j][b]);
      for (int j = 0; j < N; ++j) r[j] = one / (r[j] + veps);
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) (Vec::loadu(&c[i][j][b]) * r[j]).store(&c[i][j][b]);
    }
  }
  for (int b = 0; b < nb; ++b)
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) out[(m0 + b) * N * N + i * N + j] = c[i][j][b];
}

// Blocks of B matrices, split over ``threads`` OpenMP threads.
template <int N>
static void sinkhorn_blocked(const float* logits, float* out, int64_t count, int64_t iters, float eps,
                             int threads) {
  constexpr int B = SINKHORN_BLOCK;
  const int64_t blocks = (count + B - 1) / B;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t k = 0; k < blocks; ++k)
    sinkhorn_block<N>(logits, out, k * B, static_cast<int>(std::min<int64_t>(B, count - k * B)), iters, eps);
}

extern "C" void sinkhorn_f32(const float* logits, float* out, int64_t count, int64_t n, int64_t iters,
                             float eps, int threads) {
  if (n == 4) {
    sinkhorn_blocked<4>(logits, out, count, iters, eps, count >= SINKHORN_THREADED_COUNT ? threads : 1);
  } else {
    sinkhorn_any(logits, out, count, n, iters, eps);
  }
}
