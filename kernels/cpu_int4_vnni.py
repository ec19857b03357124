"""int4 weights times int8 activations on AVX-512 VNNI: weight-only int4 projections at 5-64
rows, where PyTorch's int4 kernel (bf16 activations) and our fp32 widening loop are
compute-bound.

llama.cpp's Q4_0 path quantizes activations to int8 per group of 32 and multiplies bytes
(``vpdpbusd``: 64 multiply-adds per instruction against 16 for an fp32 FMA); this kernel does
the same with our int4 format (``w = (q - 8) * s + z`` per group of 32 with bf16 ``s`` and
``z``, ``weight_only``), stored as one stream per weight row: each tile's nibbles, then its
scales and zeros. Each group's
integer dot product needs its own scales, so the bytes are laid out with one group per 32-bit
lane: sixteen groups side by side, four elements of each per lane and step. Eight
``vpdpbusd`` then leave sixteen finished group sums in one register, which meet their sixteen
weight and activation scales with one multiply and one FMA; the offsets add
``c * s_x * sum(x_q)`` per group the same way. A tail of fewer than sixteen groups (K not a
multiple of 512, e.g. SmolLM2's 576 = 16 + 2 groups) spreads each group over 2 or 4 lanes, so
it takes 4 or 2 ``vpdpbusd`` per step pair instead of a whole tile's 8 with most lanes idle
(K = 576 projections: 155 -> 190 GMAC/s at 32 rows, RESULTS.md). Activations round to int8 per group
(``s_x = max|x| / 127``), so results differ from the fp32-activation loop by that rounding,
as llama.cpp's do.

A row's result depends only on its own activations and the weights (fixed order), so it is
the same whatever it is batched with. Built once per machine by ``cpu_build``; ``available()``
is false without a compiler or without AVX-512 VNNI, and callers keep PyTorch's kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build

GROUP = 32
LANES = 16  # groups per tile (one per 32-bit lane of a 512-bit register)

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" int has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// A tile holds L <= 16 groups. A whole tile puts one group in each 32-bit lane; a short
// tail tile (K not a multiple of 512) spreads each group over P lanes (lanes_per_group), so
// it takes 8 / P steps instead of 8 with most lanes idle: at K = 576 the tail's two groups
// cost a quarter of a whole tile, not a whole one. Element e of local group gl: lane
// l = gl * P + (e / 4) % P, step t = e / (4 P), byte j = e % 4, over U = L * P lanes.
// Activations sit at x[t * 4U + 4l + j] (bytes); weights as nibbles, steps 2p (low) and
// 2p + 1 (high) sharing byte p * 4U + 4l + j.
static inline int64_t tile_lanes(int64_t groups, int64_t tile) { return std::min<int64_t>(16, groups - tile * 16); }
static inline int64_t lanes_per_group(int64_t L) { return L <= 4 ? 4 : (L <= 8 ? 2 : 1); }
static inline int lanes_shift(int64_t P) { return P == 4 ? 2 : (P == 2 ? 1 : 0); }

// Bytes of one packed weight row: per tile of L groups, 16 L bytes of nibbles, then the L
// groups' bf16 scales and bf16 zeros (one stream per row, as many bytes as PyTorch's layout).
static inline int64_t row_bytes(int64_t K) { return K / 2 + 4 * (K / 32); }

// q [N, K] (0..15), scale / zero [N, G] as bf16 bits -> packed [N, row_bytes(K)].
extern "C" void pack_weights(const uint8_t* q, const uint16_t* scale, const uint16_t* zero, uint8_t* packed,
                             int64_t N, int64_t K) {
  const int64_t G = K / 32, tiles = (G + 15) / 16;
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* out = packed + n * row_bytes(K);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t L = tile_lanes(G, tile), P = lanes_per_group(L), U = L * P;
      for (int64_t p = 0; p < 4 / P; ++p)
        for (int64_t l = 0; l < U; ++l)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t* g = q + n * K + (tile * 16 + l / P) * 32;
            const int64_t lo = (2 * p) * 4 * P + (l % P) * 4 + j, hi = lo + 4 * P;
            out[p * 4 * U + 4 * l + j] = static_cast<uint8_t>(g[lo] | (g[hi] << 4));
          }
      std::memcpy(out + 16 * L, scale + n * G + tile * 16, 2 * L);
      std::memcpy(out + 18 * L, zero + n * G + tile * 16, 2 * L);
      out += 20 * L;
    }
  }
}

// x [M, K] fp32 -> xq [M, K] int8 in the tile layout, sx [M, G] (scale) and cx [M, G]
// (scale * sum of the group's int8 values). Rounds to nearest even, as nearbyint does.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void quantize_rows(
    const float* x, int8_t* xq, float* sx, float* cx, int64_t M, int64_t K) {
  const int64_t G = K / 32, tiles = (G + 15) / 16;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* out = xq + m * K;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t L = tile_lanes(G, tile), P = lanes_per_group(L), U = L * P;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t g = tile * 16 + l;
        const float* xg = x + m * K + g * 32;
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float s = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        alignas(32) int8_t bytes[32];
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm512_cvtepi32_epi8(qa));
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes + 16), _mm512_cvtepi32_epi8(qb));
        for (int c = 0; c < 8; ++c) std::memcpy(out + (c / P) * 4 * U + 4 * (l * P + c % P), bytes + 4 * c, 4);
        sx[m * G + g] = s;
        cx[m * G + g] = s * static_cast<float>(sum);
      }
      out += 32 * L;
    }
  }
}

constexpr int64_t PREFETCH = 4 * 1024;  // bytes ahead of each weight row's reads

__attribute__((target("avx512f,avx512bw"))) static inline __m512 bf16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// R weight rows x MC activation rows: each weight vector feeds MC rows, each activation
// vector R rows, every integer accumulator in a register.
template <int R, int MC>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void tile_pass(
    const uint8_t* w, const int8_t* xq, const float* sx, const float* cx, const float* bias, float* y, int64_t N,
    int64_t K, int64_t n0) {
  const int64_t G = K / 32, tiles = (G + 15) / 16;
  __m512 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  int64_t woff = 0, xoff = 0;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t L = tile_lanes(G, tile), P = lanes_per_group(L), U = L * P;
    const __mmask64 bytes = U == 16 ? ~0ULL : ((1ULL << (4 * U)) - 1);
    const __mmask16 lanes = static_cast<__mmask16>((1u << L) - 1);
    __m512i iacc[R][MC];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MC; ++m) iacc[r][m] = _mm512_setzero_si512();
    for (int64_t p = 0; p < 4 / P; ++p) {
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* src = w + (n0 + r) * row_bytes(K) + woff + p * 4 * U;
        _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH), _MM_HINT_T0);
        const __m512i packed = U == 16 ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(bytes, src);
        lo[r] = _mm512_and_si512(packed, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
      for (int m = 0; m < MC; ++m) {
        const int8_t* xr = xq + m * K + xoff;
        const __m512i xa = U == 16 ? _mm512_loadu_si512(xr + (2 * p) * 4 * U)
                                   : _mm512_maskz_loadu_epi8(bytes, xr + (2 * p) * 4 * U);
        const __m512i xb = U == 16 ? _mm512_loadu_si512(xr + (2 * p + 1) * 4 * U)
                                   : _mm512_maskz_loadu_epi8(bytes, xr + (2 * p + 1) * 4 * U);
        for (int r = 0; r < R; ++r) {
          iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], lo[r], xa);
          iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], hi[r], xb);
        }
      }
    }
    // a group's P lanes take its scales; its offset term is added in its first lane only
    const __m512i group = _mm512_srli_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), lanes_shift(P));
    const __mmask16 first = static_cast<__mmask16>(
        P == 1 ? lanes : (P == 2 ? 0x5555 : 0x1111) & ((1u << U) - 1));
    for (int r = 0; r < R; ++r) {
      const uint8_t* sc = w + (n0 + r) * row_bytes(K) + woff + 16 * L;  // bf16 scales, then offsets
      __m512 s = bf16_to_f32(_mm256_maskz_loadu_epi16(lanes, sc));
      // w = (q - 8) * s + z = q * s + c with c = z - 8 s, rounded once
      __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16_to_f32(_mm256_maskz_loadu_epi16(lanes, sc + 2 * L)));
      if (P > 1) {
        s = _mm512_permutexvar_ps(group, s);
        c = _mm512_permutexvar_ps(group, c);
      }
      for (int m = 0; m < MC; ++m) {
        __m512 xs = _mm512_maskz_loadu_ps(lanes, sx + m * G + tile * 16);
        __m512 xc = _mm512_maskz_loadu_ps(lanes, cx + m * G + tile * 16);
        if (P > 1) {
          xs = _mm512_permutexvar_ps(group, xs);
          xc = _mm512_maskz_permutexvar_ps(first, group, xc);
        }
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][m]), _mm512_mul_ps(s, xs), acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(c, xc, acc[r][m]);
      }
    }
    woff += 20 * L;
    xoff += 32 * L;
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n0 + r] : 0.f);
}

constexpr int R = 4, MC = 4;

template <int RR>
static void rows_block(const uint8_t* w, const float* bias, const int8_t* xq, const float* sx, const float* cx,
                       float* y, int64_t M, int64_t N, int64_t K, int64_t n0) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += MC) {
    const int8_t* xm = xq + m * K;
    const float* sxm = sx + m * G;
    const float* cxm = cx + m * G;
    float* ym = y + m * N;
    switch (std::min<int64_t>(MC, M - m)) {
      case 1: tile_pass<RR, 1>(w, xm, sxm, cxm, bias, ym, N, K, n0); break;
      case 2: tile_pass<RR, 2>(w, xm, sxm, cxm, bias, ym, N, K, n0); break;
      case 3: tile_pass<RR, 3>(w, xm, sxm, cxm, bias, ym, N, K, n0); break;
      default: tile_pass<RR, MC>(w, xm, sxm, cxm, bias, ym, N, K, n0); break;
    }
  }
}

// y [M, N] = x [M, K] @ W.T (+ bias) for W packed by pack_weights.
// scratch: M * K bytes + 2 * M * G floats.
extern "C" void gemm_i4_i8(const float* x, const uint8_t* w, const float* bias, float* y, void* scratch, int64_t M,
                           int64_t N, int64_t K, int threads) {
  const int64_t G = K / 32;
  int8_t* xq = static_cast<int8_t*>(scratch);
  float* sx = reinterpret_cast<float*>(xq + M * K);
  float* cx = sx + M * G;
  quantize_rows(x, xq, sx, cx, M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    switch (std::min<int64_t>(R, N - n0)) {
      case 1: rows_block<1>(w, bias, xq, sx, cx, y, M, N, K, n0); break;
      case 2: rows_block<2>(w, bias, xq, sx, cx, y, M, N, K, n0); break;
      case 3: rows_block<3>(w, bias, xq, sx, cx, y, M, N, K, n0); break;
      default: rows_block<R>(w, bias, xq, sx, cx, y, M, N, K, n0); break;
    }
  }
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is None:
        return None
    lib.has_vnni.restype = ctypes.c_int
    if not lib.has_vnni():
        return None
    cpu_build.bind(lib, "pack_weights", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2)
    cpu_build.bind(lib, "gemm_i4_i8", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int])
    return lib


def available() -> bool:
    """A compiler and a CPU with AVX-512 VNNI."""
    return _library() is not None


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] (0..15, K a multiple of 32) with bf16 ``scale`` / ``zero``
    [N, K / 32] (``w = (q - 8) * scale + zero``, PyTorch's int4 form) -> the kernel's packed
    rows [N, K / 2 + 4 K / 32] (uint8)."""
    lib = _library()
    assert lib is not None
    q = q.to(torch.uint8).contiguous()
    n, k = q.shape
    s = scale.to(torch.bfloat16).contiguous().view(torch.int16)
    c = zero.to(torch.bfloat16).contiguous().view(torch.int16)
    packed = torch.empty(n, k // 2 + 4 * (k // GROUP), dtype=torch.uint8)
    lib.pack_weights(q.data_ptr(), s.data_ptr(), c.data_ptr(), packed.data_ptr(), n, k)
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x [M, K] @ W.T (+ bias)`` for ``W`` packed by ``pack``, with the activations
    rounded to int8 per group of 32."""
    lib = _library()
    assert lib is not None
    x = x.float().contiguous()
    m, k = x.shape
    n = packed.shape[0]
    if k % GROUP or packed.shape[1] != k // 2 + 4 * (k // GROUP):
        raise ValueError(f"gemm: x has {k} columns, packed weight {tuple(packed.shape)}")
    y = torch.empty(m, n)
    scratch = torch.empty(m * k + 8 * m * (k // GROUP), dtype=torch.uint8)
    b = bias.float().contiguous() if bias is not None else None
    lib.gemm_i4_i8(
        x.data_ptr(),
        packed.data_ptr(),
        b.data_ptr() if b is not None else None,
        y.data_ptr(),
        scratch.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y
