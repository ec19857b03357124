// The grouped low-rank product of served LoRA adapters (SGMV) over a step's adapter rows;
// built and called by lora.py.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cstdint>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t BLOCK = 8;  // rows sharing one read of the slot's matrices
constexpr int64_t KB = 64;    // the shrink sums blocks of KB products, then the blocks

static inline Vec load(const float* p, int64_t n) { return n == V ? Vec::loadu(p) : Vec::loadu(p, n); }

// u[r, c] = sum_k x[rows[r], k] * a[k, c] for the ROWS rows of a block (a [in, width])
template <int ROWS>
static void shrink(const float* x, int64_t in, const int64_t* rows, const float* a, int64_t width, float* u) {
  for (int64_t c0 = 0; c0 < width; c0 += V) {
    const int64_t cw = std::min(V, width - c0);
    Vec total[ROWS];
    for (int r = 0; r < ROWS; ++r) total[r] = Vec(0.f);
    for (int64_t k0 = 0; k0 < in; k0 += KB) {
      Vec acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = Vec(0.f);
      for (int64_t k = k0; k < std::min(in, k0 + KB); ++k) {
        const Vec av = load(a + k * width + c0, cw);
        for (int r = 0; r < ROWS; ++r) acc[r] = at::vec::fmadd(Vec(x[rows[r] * in + k]), av, acc[r]);
      }
      for (int r = 0; r < ROWS; ++r) total[r] = total[r] + acc[r];
    }
    for (int r = 0; r < ROWS; ++r) total[r].store(u + r * width + c0, cw);
  }
}

// y[rows[r], offset + c] += sum_q u[r, col + q] * b[q, c] for the ROWS rows (b [rank, out])
template <int ROWS>
static void expand(const float* u, int64_t width, int64_t col, int64_t rank, const float* b, int64_t out,
                   float* y, const int64_t* rows, int64_t out_total, int64_t offset) {
  for (int64_t c0 = 0; c0 < out; c0 += V) {
    const int64_t cw = std::min(V, out - c0);
    Vec acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = Vec(0.f);
    for (int64_t q = 0; q < rank; ++q) {
      const Vec bv = load(b + q * out + c0, cw);
      for (int r = 0; r < ROWS; ++r) acc[r] = at::vec::fmadd(Vec(u[r * width + col + q]), bv, acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) {
      float* yr = y + rows[r] * out_total + offset + c0;
      (load(yr, cw) + acc[r]).store(yr, cw);
    }
  }
}

template <int ROWS>
static void block(const float* x, int64_t in, const int64_t* rows, const float* a, int64_t rank, int64_t n,
                  const float* const* bs, const int64_t* outs, int64_t slot, float* y, int64_t out_total,
                  float* u) {
  const int64_t width = n * rank;
  shrink<ROWS>(x, in, rows, a + slot * in * width, width, u);
  int64_t offset = 0;
  for (int64_t j = 0; j < n; ++j) {
    expand<ROWS>(u, width, j * rank, rank, bs[j] + slot * rank * outs[j], outs[j], y, rows, out_total, offset);
    offset += outs[j];
  }
}

extern "C" {
// For each group g (slot group_slot[g], rows rows[group_start[g] .. group_start[g + 1])):
//   y[row, :] += concat_j((x[row, :] @ a[slot])[:, j R : (j + 1) R] @ b_j[slot])
// x [T, in]; a [L, in, n R]; b_j [L, R, outs[j]] at bs[j]; y [T, sum outs] (row-major). Work
// splits by (group, block of up to BLOCK rows): a block reads its slot's matrices once and
// writes only its own rows of y, so blocks run on ATen's threads in any order.
void lora_sgmv_f32(const float* x, int64_t in, const int64_t* rows, const int64_t* group_slot,
                   const int64_t* group_start, int64_t groups, const float* a, int64_t rank, int64_t n,
                   const float* const* bs, const int64_t* outs, float* y, int64_t out_total) {
  std::vector<int64_t> item_group, item_first;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = group_start[g]; r < group_start[g + 1]; r += BLOCK) {
      item_group.push_back(g);
      item_first.push_back(r);
    }
  }
  const int64_t items = static_cast<int64_t>(item_group.size());
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(BLOCK * n * rank);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = item_group[it], first = item_first[it];
      const int64_t count = std::min(BLOCK, group_start[g + 1] - first);
      const int64_t* block_rows = rows + first;
      const int64_t slot = group_slot[g];
      switch (count) {
#define LORA_BLOCK(N) \
  case N:             \
    block<N>(x, in, block_rows, a, rank, n, bs, outs, slot, y, out_total, u.data()); \
    break;
        LORA_BLOCK(1) LORA_BLOCK(2) LORA_BLOCK(3) LORA_BLOCK(4)
        LORA_BLOCK(5) LORA_BLOCK(6) LORA_BLOCK(7) LORA_BLOCK(8)
#undef LORA_BLOCK
      }
    }
  });
}
}
