// int4 x int8 GEMM on AVX-512 VNNI or AVX2; built and called by int4_vnni.py.

#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

// 2: AVX-512 VNNI (vpdpbusd); 1: AVX2 (vpmaddubsw + vpmaddwd); 0: neither
extern "C" int int8_dot_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 1 : 0;
}

// A block of 16 weight rows, per group of 32 input channels: 4 x 64 bytes of nibbles (pair p:
// lane i = row i, byte j holds element 8p + j (low) and 8p + 4 + j (high)), then the 16 rows'
// fp16 scales and fp16 zeros: 320 bytes a group, 16 rows x (K / 2 + 4 K / 32) bytes a block.
constexpr int64_t GROUP_BYTES = 320;
static inline int64_t block_bytes(int64_t K) { return (K / 32) * GROUP_BYTES; }

// q [N, K] (0..15), scale / zero [N, G] as fp16 bits -> packed [ceil(N / 16) blocks]; rows past
// N are zero.
extern "C" void pack_weights(const uint8_t* q, const uint16_t* scale, const uint16_t* zero, uint8_t* packed,
                             int64_t N, int64_t K) {
  const int64_t G = K / 32, blocks = (N + 15) / 16;
  std::memset(packed, 0, blocks * block_bytes(K));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* out = packed + b * block_bytes(K) + g * GROUP_BYTES;
      uint16_t* s = reinterpret_cast<uint16_t*>(out + 256);
      for (int64_t i = 0; i < 16 && b * 16 + i < N; ++i) {
        const int64_t n = b * 16 + i;
        const uint8_t* src = q + n * K + g * 32;
        for (int64_t p = 0; p < 4; ++p)
          for (int64_t j = 0; j < 4; ++j)
            out[p * 64 + 4 * i + j] = static_cast<uint8_t>(src[8 * p + j] | (src[8 * p + 4 + j] << 4));
        s[i] = scale[n * G + g];
        s[16 + i] = zero[n * G + g];
      }
    }
}

// x [M, K] fp32 -> xq [M, K] int8, sx [M, G] (scale) and cx [M, G] (scale * sum of the group's
// int8 values). Rounds to nearest even, as nearbyint does.
__attribute__((target("avx512f,avx512bw,avx512dq"))) static void quantize_rows(
    const float* x, int8_t* xq, float* sx, float* cx, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
      const float s = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + g * 32), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + g * 32 + 16), _mm512_cvtepi32_epi8(qb));
      sx[m * G + g] = s;
      cx[m * G + g] = s * static_cast<float>(sum);
    }
}

constexpr int64_t PREFETCH = 4 * 1024;  // bytes ahead of each block's reads

__attribute__((target("avx512f,avx512bw"))) static inline __m512 f16_to_f32(__m256i bits) {
  return _mm512_cvtph_ps(bits);
}

static inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// RB blocks (16 RB weight rows) x MC activation rows: each weight vector feeds MC rows, each
// broadcast activation word RB blocks, every accumulator in a register.
template <int RB, int MC>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void block_pass(
    const uint8_t* w, const int8_t* xq, const float* sx, const float* cx, const float* bias, float* y, int64_t N,
    int64_t K, int64_t b0) {
  const int64_t G = K / 32;
  __m512 acc[RB][MC];
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512i iacc[RB][MC];
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MC; ++m) iacc[r][m] = _mm512_setzero_si512();
    for (int64_t p = 0; p < 4; ++p) {
      __m512i lo[RB], hi[RB];
      for (int r = 0; r < RB; ++r) {
        const uint8_t* src = w + (b0 + r) * block_bytes(K) + g * GROUP_BYTES + p * 64;
        _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH), _MM_HINT_T0);
        const __m512i packed = _mm512_loadu_si512(src);
        lo[r] = _mm512_and_si512(packed, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
      for (int m = 0; m < MC; ++m) {
        const int8_t* xr = xq + m * K + g * 32 + 8 * p;
        const __m512i xa = _mm512_set1_epi32(four_bytes(xr));
        const __m512i xb = _mm512_set1_epi32(four_bytes(xr + 4));
        for (int r = 0; r < RB; ++r) {
          iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], lo[r], xa);
          iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], hi[r], xb);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const uint8_t* sc = w + (b0 + r) * block_bytes(K) + g * GROUP_BYTES + 256;  // scales, then zeros
      const __m512 s = f16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      // w = (q - 8) * s + z = q * s + c with c = z - 8 s, rounded once
      const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s,
                                        f16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32))));
      for (int m = 0; m < MC; ++m) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(sx[m * G + g]));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][m]), scale, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(c, _mm512_set1_ps(cx[m * G + g]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int64_t n0 = (b0 + r) * 16;
    const __mmask16 keep = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MC; ++m) _mm512_mask_storeu_ps(y + m * N + n0, keep, _mm512_add_ps(acc[r][m], b));
  }
}

constexpr int RB = 2, MC = 4;

template <int R>
static void rows_block(const uint8_t* w, const float* bias, const int8_t* xq, const float* sx, const float* cx,
                       float* y, int64_t M, int64_t N, int64_t K, int64_t b0) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += MC) {
    const int8_t* xm = xq + m * K;
    const float* sxm = sx + m * G;
    const float* cxm = cx + m * G;
    float* ym = y + m * N;
    switch (std::min<int64_t>(MC, M - m)) {
      case 1: block_pass<R, 1>(w, xm, sxm, cxm, bias, ym, N, K, b0); break;
      case 2: block_pass<R, 2>(w, xm, sxm, cxm, bias, ym, N, K, b0); break;
      case 3: block_pass<R, 3>(w, xm, sxm, cxm, bias, ym, N, K, b0); break;
      default: block_pass<R, MC>(w, xm, sxm, cxm, bias, ym, N, K, b0); break;
    }
  }
}

// ---- AVX2 (no VNNI: AMD Zen 2/3, Intel before Ice Lake). The same packed blocks, each read as
// two halves of 8 rows (one per 32-bit lane of a 256-bit register). vpmaddubsw multiplies the
// weight bytes (0..15) by the activation bytes (-127..127) and adds pairs into int16; a group's
// eight such products per lane stay below 8 x 2 x 15 x 127 = 30,480, so they add up exactly in
// int16, and one vpmaddwd by ones finishes the group's sum per row in int32. Quantization, the
// group sums and the float steps after them are the AVX-512 path's, operation for operation, so
// both should give the same bits (compared by the kernel test where a CPU runs both).

__attribute__((target("avx2,fma,f16c"))) static void quantize_rows_avx2(
    const float* x, int8_t* xq, float* sx, float* cx, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float s = _mm_cvtss_f32(h) / 127.f;
      const __m256 inv = _mm256_set1_ps(s > 0.f ? 1.f / s : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + g * 32), bytes);
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
      sx[m * G + g] = s;
      cx[m * G + g] = s * static_cast<float>(_mm_cvtsi128_si32(u));
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline __m256 f16_to_f32_avx2(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One block (16 weight rows, two halves of 8) x MC activation rows.
template <int MC>
__attribute__((target("avx2,fma,f16c"))) static inline void block_pass_avx2(
    const uint8_t* w, const int8_t* xq, const float* sx, const float* cx, const float* bias, float* y, int64_t N,
    int64_t K, int64_t b) {
  const int64_t G = K / 32;
  const uint8_t* blk = w + b * block_bytes(K);
  __m256 acc[2][MC];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MC; ++m) acc[h][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = blk + g * GROUP_BYTES;
    __m256i sum16[2][MC];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MC; ++m) sum16[h][m] = _mm256_setzero_si256();
    for (int64_t p = 0; p < 4; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(grp + p * 64 + PREFETCH), _MM_HINT_T0);
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + p * 64 + h * 32));
        lo[h] = _mm256_and_si256(packed, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      }
      for (int m = 0; m < MC; ++m) {
        const int8_t* xr = xq + m * K + g * 32 + 8 * p;
        const __m256i xa = _mm256_set1_epi32(four_bytes(xr));
        const __m256i xb = _mm256_set1_epi32(four_bytes(xr + 4));
        for (int h = 0; h < 2; ++h)
          sum16[h][m] = _mm256_add_epi16(
              sum16[h][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa), _mm256_maddubs_epi16(hi[h], xb)));
      }
    }
    _mm_prefetch(reinterpret_cast<const char*>(grp + 256 + PREFETCH), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = f16_to_f32_avx2(grp + 256 + 16 * h);
      const __m256 c = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, f16_to_f32_avx2(grp + 288 + 16 * h));
      for (int m = 0; m < MC; ++m) {
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[h][m], ones));
        const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(sx[m * G + g]));
        acc[h][m] = _mm256_fmadd_ps(isum, scale, acc[h][m]);
        acc[h][m] = _mm256_fmadd_ps(c, _mm256_set1_ps(cx[m * G + g]), acc[h][m]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t n0 = b * 16 + 8 * h;
    if (n0 >= N) break;
    const int valid = static_cast<int>(std::min<int64_t>(8, N - n0));
    alignas(32) float out[8], bv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (bias)
      for (int i = 0; i < valid; ++i) bv[i] = bias[n0 + i];
    const __m256 bias_v = _mm256_load_ps(bv);
    for (int m = 0; m < MC; ++m) {
      const __m256 r = _mm256_add_ps(acc[h][m], bias_v);
      if (valid == 8) {
        _mm256_storeu_ps(y + m * N + n0, r);
      } else {
        _mm256_store_ps(out, r);
        std::memcpy(y + m * N + n0, out, valid * sizeof(float));
      }
    }
  }
}

constexpr int MC_AVX2 = 4;

static void rows_block_avx2(const uint8_t* w, const float* bias, const int8_t* xq, const float* sx,
                            const float* cx, float* y, int64_t M, int64_t N, int64_t K, int64_t b) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += MC_AVX2) {
    const int8_t* xm = xq + m * K;
    const float *sxm = sx + m * G, *cxm = cx + m * G;
    float* ym = y + m * N;
    switch (std::min<int64_t>(MC_AVX2, M - m)) {
      case 1: block_pass_avx2<1>(w, xm, sxm, cxm, bias, ym, N, K, b); break;
      case 2: block_pass_avx2<2>(w, xm, sxm, cxm, bias, ym, N, K, b); break;
      case 3: block_pass_avx2<3>(w, xm, sxm, cxm, bias, ym, N, K, b); break;
      default: block_pass_avx2<MC_AVX2>(w, xm, sxm, cxm, bias, ym, N, K, b); break;
    }
  }
}

// y [M, N] = x [M, K] @ W.T (+ bias) for W packed by pack_weights, on AVX-512 VNNI (isa 2) or
// AVX2 (isa 1; an AVX-512 VNNI CPU runs both). scratch: M * K bytes + 2 * M * G floats.
extern "C" void gemm_i4_i8_isa(int isa, const float* x, const uint8_t* w, const float* bias, float* y,
                               void* scratch, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t G = K / 32, blocks = (N + 15) / 16;
  int8_t* xq = static_cast<int8_t*>(scratch);
  float* sx = reinterpret_cast<float*>(xq + M * K);
  float* cx = sx + M * G;
  if (isa == 2) {
    quantize_rows(x, xq, sx, cx, M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < blocks; b0 += RB) {
      if (RB > 1 && blocks - b0 < RB) rows_block<1>(w, bias, xq, sx, cx, y, M, N, K, b0);
      else rows_block<RB>(w, bias, xq, sx, cx, y, M, N, K, b0);
    }
  } else if (isa == 1) {
    quantize_rows_avx2(x, xq, sx, cx, M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; ++b) rows_block_avx2(w, bias, xq, sx, cx, y, M, N, K, b);
  }
}

// the same on the best instructions this CPU has (what the engine and the decode stack call)
extern "C" void gemm_i4_i8(const float* x, const uint8_t* w, const float* bias, float* y, void* scratch, int64_t M,
                           int64_t N, int64_t K, int threads) {
  static const int isa = int8_dot_isa();
  gemm_i4_i8_isa(isa, x, w, bias, y, scratch, M, N, K, threads);
}
