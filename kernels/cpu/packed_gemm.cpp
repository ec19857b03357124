// fp32, bf16 and int8 projections on a packed weight copy; built and called by packed_gemm.py,
// and compiled into the packed-linear op (linear_op.py).

#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <c10/util/Half.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();
// activation rows per pass: 2 x MR accumulators, two weight vectors and a broadcast fit the
// vector registers (32 on AVX-512, 16 on AVX2)
constexpr int MR = V >= 16 ? 12 : 6;

extern "C" int64_t packed_gemm_width() { return 2 * V; }  // outputs per packed tile

// V weights as fp32 (int8 widened exactly)
inline Vec load_w(const float* p) { return Vec::loadu(p); }
inline Vec load_w(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float b[V];
  for (int i = 0; i < V; ++i) b[i] = static_cast<float>(p[i]);
  return Vec::loadu(b);
#endif
}
// bf16 weights (their 16 bits are an fp32's top half: widened exactly by a shift)
inline Vec load_w(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#else
  alignas(64) float b[V];
  for (int i = 0; i < V; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(b + i, &bits, sizeof(float));
  }
  return Vec::loadu(b);
#endif
}

// int8 weights: inputs per scale, and V fp16 scales widened to fp32
constexpr int64_t GROUP = 32;
inline Vec load_scales(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  alignas(64) float b[V];
  for (int i = 0; i < V; ++i) b[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return Vec::loadu(b);
#endif
}

// What a pass prefetches (PF): a single pass (at most MR rows) its own tile, AHEAD_BYTES ahead
// (PF_OWN); a pass of a few (up to SPREAD_PASSES) its share of the next tile, which the
// following passes re-read from L2 (PF_SHARE: pass p of P covers bytes [p / P, (p + 1) / P) of
// it, one prefetch per k step advancing 1 / (P K) of it in 16-bit fixed point, at most a line a
// step, so no line is skipped, and the next tile streams in under all P passes); a pass of many
// all of the next tile (PF_WHOLE: a share of one pass in twenty-two came too thin). Asking for
// the whole next tile in the first of three passes (32 rows) filled the line buffers in a third
// of the tile's time and left the memory stream and the FMAs taking turns: SmolLM2's stack at
// 32 rows took the sum of both times (benchmarks/RESULTS.md).
constexpr int PF_OWN = 0, PF_SHARE = 1, PF_WHOLE = 2;
constexpr int64_t AHEAD_BYTES = 8192;
constexpr int64_t SPREAD_PASSES = 12;  // up to 144 rows
struct Prefetch {
  const char* base;
  int64_t pos, inc;
};

inline Prefetch share(const void* next, int64_t tile_bytes, int64_t pass, int64_t passes, int64_t K) {
  return {static_cast<const char*>(next), (pass * tile_bytes << 16) / passes, (tile_bytes << 16) / (passes * K)};
}

// y[m, n0 + i] for i < 2V outputs and R rows; w: the tile ([K][2V], one linear stream); pf:
// the next tile to prefetch (PF_SHARE: this pass's share; PF_WHOLE: all; unused for PF_OWN);
// int8 weights meet their group's scale before the product (scale: every tile's fp16 scales,
// [tiles][ceil(K / 32)][2V])
template <typename W, int R, int PF>
inline void tile(const float* x, const W* w, Prefetch pf, const uint16_t* scale, const float* bias, float* y,
                 int64_t N, int64_t K, int64_t n0) {
  constexpr bool grouped = std::is_same_v<W, int8_t>;
  const uint16_t* gs = grouped ? scale + n0 * ((K + GROUP - 1) / GROUP) : nullptr;
  Vec acc[2][R];
  for (int b = 0; b < 2; ++b)
    for (int m = 0; m < R; ++m) acc[b][m] = Vec(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += GROUP) {
    Vec s0(1.f), s1(1.f);
    if constexpr (grouped) {
      s0 = load_scales(gs + k0 / GROUP * 2 * V);
      s1 = load_scales(gs + k0 / GROUP * 2 * V + V);
    }
    const int64_t k1 = std::min(K, k0 + GROUP);
    for (int64_t k = k0; k < k1; ++k) {
      const W* wk = w + k * 2 * V;
      Vec w0 = load_w(wk), w1 = load_w(wk + V);
      if constexpr (grouped) {
        w0 = w0 * s0;
        w1 = w1 * s1;
      }
      if constexpr (PF == PF_SHARE) {
        __builtin_prefetch(pf.base + (pf.pos >> 16));
        pf.pos += pf.inc;
      } else if constexpr (PF == PF_WHOLE) {
        for (int64_t line = 0; line < static_cast<int64_t>(2 * V * sizeof(W)); line += 64)
          __builtin_prefetch(pf.base + k * 2 * V * static_cast<int64_t>(sizeof(W)) + line);
      } else {  // every cache line of this step's 2V weights, AHEAD_BYTES on (fp32: two lines)
        const char* ahead = reinterpret_cast<const char*>(wk) + AHEAD_BYTES;
        for (int64_t line = 0; line < static_cast<int64_t>(2 * V * sizeof(W)); line += 64)
          __builtin_prefetch(ahead + line);
      }
      for (int m = 0; m < R; ++m) {
        const Vec xv(x[m * K + k]);
        acc[0][m] = at::vec::fmadd(w0, xv, acc[0][m]);
        acc[1][m] = at::vec::fmadd(w1, xv, acc[1][m]);
      }
    }
  }
  for (int b = 0; b < 2; ++b) {
    const int64_t n = n0 + b * V;
    if (n >= N) break;
    const int valid = static_cast<int>(std::min<int64_t>(V, N - n));
    const Vec bv = bias ? Vec::loadu(bias + n, valid) : Vec(0.f);
    for (int m = 0; m < R; ++m) {
      Vec r = acc[b][m];
      if (bias) r = r + bv;
      if (valid == V) r.store(y + m * N + n);
      else r.store(y + m * N + n, valid);
    }
  }
}

// the last r < MR rows of a pass sequence
template <typename W, int R, int PF>
inline void tail(int64_t r, const float* x, const W* w, Prefetch pf, const uint16_t* scale, const float* bias,
                 float* y, int64_t N, int64_t K, int64_t n0) {
  if constexpr (R > 0) {
    if (r == R) tile<W, R, PF>(x, w, pf, scale, bias, y, N, K, n0);
    else tail<W, R - 1, PF>(r, x, w, pf, scale, bias, y, N, K, n0);
  }
}

template <typename W>
inline void passes(const float* x, const W* w, const W* next, const uint16_t* scale, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K, int64_t n0) {
  if (M <= MR) {  // one pass: read the tile once, prefetching along it
    tail<W, MR, PF_OWN>(M, x, w, Prefetch{}, scale, bias, y, N, K, n0);
    return;
  }
  const int64_t count = (M + MR - 1) / MR, bytes = K * 2 * V * static_cast<int64_t>(sizeof(W));
  int64_t m = 0, pass = 0;
  if (count <= SPREAD_PASSES) {
    for (; m + MR <= M; m += MR, ++pass)
      tile<W, MR, PF_SHARE>(x + m * K, w, share(next, bytes, pass, count, K), scale, bias, y + m * N, N, K, n0);
    tail<W, MR - 1, PF_SHARE>(M - m, x + m * K, w, share(next, bytes, pass, count, K), scale, bias, y + m * N, N,
                              K, n0);
    return;
  }
  const Prefetch whole{static_cast<const char*>(static_cast<const void*>(next)), 0, 0};
  for (; m + MR <= M; m += MR) tile<W, MR, PF_WHOLE>(x + m * K, w, whole, scale, bias, y + m * N, N, K, n0);
  tail<W, MR - 1, PF_WHOLE>(M - m, x + m * K, w, whole, scale, bias, y + m * N, N, K, n0);
}

// Rows first (every tile for one block of MR rows, then the next block) where the packed weight
// fits in L2 and the rows are many: the block's activations stay in L1 across the tiles and
// its outputs are written whole, where tiles first re-read all rows from L2 once per tile; the
// tiny V4's projections (K = 32-256, N = 8-258) at 2,048 rows run as fast or faster this way
// (benchmarks/RESULTS.md). The tiles keep PF_OWN's prefetches, although the weights sit in
// cache: the same loop without them ran much slower (measured, not explained).
constexpr int64_t ROWS_FIRST_MAX_BYTES = 128 * 1024;
constexpr int64_t ROWS_FIRST_MIN_ROWS = 8 * MR;

template <typename W>
void rows_first(const float* x, const W* p, const uint16_t* scale, const float* bias, float* y, int64_t M,
                int64_t N, int64_t K, int64_t tiles, int threads) {
  const int64_t blocks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m0 = b * MR, r = std::min<int64_t>(MR, M - m0);
    if (r == MR) {
      for (int64_t t = 0; t < tiles; ++t)
        tile<W, MR, PF_OWN>(x + m0 * K, p + t * K * 2 * V, Prefetch{}, scale, bias, y + m0 * N, N, K, t * 2 * V);
    } else {
      for (int64_t t = 0; t < tiles; ++t)
        tail<W, MR - 1, PF_OWN>(r, x + m0 * K, p + t * K * 2 * V, Prefetch{}, scale, bias, y + m0 * N, N, K,
                                 t * 2 * V);
    }
  }
}

// y [M, N] = x [M, K] @ W.T (+ bias [N]), W packed as [ceil(N / 2V)][K][2V] (int8: each weight
// times its group's scale). Work items are tiles, and also row ranges (multiples of MR) when
// there are few tiles per thread.
template <typename W>
void packed_gemm(const float* x, const W* p, const uint16_t* scale, const float* bias, float* y, int64_t M,
                 int64_t N, int64_t K, int threads) {
  if (M <= 0 || N <= 0) return;
  const int64_t tiles = (N + 2 * V - 1) / (2 * V);
  if (M >= ROWS_FIRST_MIN_ROWS && tiles * K * 2 * V * static_cast<int64_t>(sizeof(W)) <= ROWS_FIRST_MAX_BYTES) {
    rows_first<W>(x, p, scale, bias, y, M, N, K, tiles, threads);
    return;
  }
  int64_t chunks = 1;
  if (tiles < 4 * threads) chunks = std::min<int64_t>((M + MR - 1) / MR, (4 * threads + tiles - 1) / tiles);
  const int64_t rows = ((M + chunks - 1) / chunks + MR - 1) / MR * MR;
  chunks = (M + rows - 1) / rows;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t item = 0; item < tiles * chunks; ++item) {
    const int64_t t = item / chunks, m0 = (item % chunks) * rows;
    const int64_t m1 = std::min(M, m0 + rows);
    const W* w = p + t * K * 2 * V;
    passes<W>(x + m0 * K, w, w + K * 2 * V, scale, bias, y + m0 * N, m1 - m0, N, K, t * 2 * V);
  }
}

extern "C" void packed_gemm_f32(const float* x, const float* p, const float* bias, float* y, int64_t M,
                                int64_t N, int64_t K, int threads) {
  packed_gemm<float>(x, p, nullptr, bias, y, M, N, K, threads);
}

// bf16 weights (raw bits), fp32 activations and sums: y = x . w + bias
extern "C" void packed_gemm_bf16(const float* x, const uint16_t* p, const float* bias, float* y, int64_t M,
                                 int64_t N, int64_t K, int threads) {
  packed_gemm<uint16_t>(x, p, nullptr, bias, y, M, N, K, threads);
}

// int8 weights with an fp16 scale per 32 inputs of an output (Q8_0's blocks), packed as
// [tiles][ceil(K / 32)][2V]: y = x . (q * scale) + bias
extern "C" void packed_gemm_i8(const float* x, const int8_t* p, const uint16_t* scale, const float* bias, float* y,
                               int64_t M, int64_t N, int64_t K, int threads) {
  packed_gemm<int8_t>(x, p, scale, bias, y, M, N, K, threads);
}
