// Llama RoPE plus the K/V cache writes in one call; built and called by rope_store.py.

#include "fp8.h"
#include "hadamard.h"
#include "int8_rows.h"
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>

constexpr int64_t PARALLEL_TOKENS = 64;

template <typename A, typename P>
void rope_store(const A* qkv, const float* cos, const float* sin, const int64_t* rows, P* k_pool,
                P* v_pool, A* q_out, int64_t T, int64_t H, int64_t KV, int64_t d) {
  const int64_t half = d / 2, width = (H + 2 * KV) * d, rw = row_elems<P>(KV * d);
  // tokens are independent: a prefill's split over ATen's threads (as many as PyTorch is set
  // to), a decode step's few run inline on the calling thread
  at::parallel_for(0, T, PARALLEL_TOKENS, [&](int64_t first, int64_t last) {
  // an 8-bit pool meets q and k rotated (kv_rotation.py), a head at a time; an int8 row is
  // encoded whole, from its values in fp32
  constexpr bool rotated = is_i8_v<P> || is_fp8_v<P>;
  std::vector<float> kbuf, vbuf, head(rotated ? d : 0);
  if constexpr (is_i8_v<P>) {
    kbuf.resize(KV * d);
    vbuf.resize(KV * d);
  }
  for (int64_t t = first; t < last; ++t) {
    const A* x = qkv + t * width;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    P* kr = k_pool + rows[t] * rw;
    P* vr = v_pool + rows[t] * rw;
    for (int64_t h = 0; h < H + KV; ++h) {
      const A* xh = x + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
        const float p1 = x1 * c[i], p2 = x2 * s[i], p3 = x2 * c[i], p4 = x1 * s[i];
        const A a = static_cast<A>(p1 - p2), b = static_cast<A>(p3 + p4);
        if constexpr (rotated) {
          head[i] = static_cast<float>(a);
          head[i + half] = static_cast<float>(b);
        } else if (h < H) {
          q_out[(t * H + h) * d + i] = a;
          q_out[(t * H + h) * d + i + half] = b;
        } else {
          kr[(h - H) * d + i] = to_pool<P>(static_cast<float>(a));
          kr[(h - H) * d + i + half] = to_pool<P>(static_cast<float>(b));
        }
      }
      if constexpr (rotated) {
        fwht(head.data(), d);
        if (h < H) {
          for (int64_t i = 0; i < d; ++i) q_out[(t * H + h) * d + i] = static_cast<A>(head[i]);
        } else if constexpr (is_i8_v<P>) {
          std::copy(head.begin(), head.end(), kbuf.begin() + (h - H) * d);
        } else {
          for (int64_t i = 0; i < d; ++i) kr[(h - H) * d + i] = to_pool<P>(head[i]);
        }
      }
    }
    const A* v = x + (H + KV) * d;
    if constexpr (is_i8_v<P>) {
      for (int64_t i = 0; i < KV * d; ++i) vbuf[i] = static_cast<float>(v[i]);
      i8_store_row(kr, kbuf.data(), KV * d);
      i8_store_row(vr, vbuf.data(), KV * d);
    } else {
      for (int64_t i = 0; i < KV * d; ++i) vr[i] = to_pool<P>(static_cast<float>(v[i]));
    }
  }
  });
}

#define ENTRY(NAME, A, P)                                                                        \
  extern "C" void NAME(const A* qkv, const float* c, const float* s, const int64_t* rows, P* k,  \
                       P* v, A* q, int64_t T, int64_t H, int64_t KV, int64_t d) {                \
    rope_store<A, P>(qkv, c, s, rows, k, v, q, T, H, KV, d);                                    \
  }
ENTRY(rope_store_f32_f32, float, float)
ENTRY(rope_store_f32_bf16, float, c10::BFloat16)
ENTRY(rope_store_bf16_f32, c10::BFloat16, float)
ENTRY(rope_store_bf16_bf16, c10::BFloat16, c10::BFloat16)
ENTRY(rope_store_f32_f16, float, c10::Half)
ENTRY(rope_store_bf16_f16, c10::BFloat16, c10::Half)
ENTRY(rope_store_f32_e4m3, float, c10::Float8_e4m3fn)
ENTRY(rope_store_bf16_e4m3, c10::BFloat16, c10::Float8_e4m3fn)
ENTRY(rope_store_f32_e5m2, float, c10::Float8_e5m2)
ENTRY(rope_store_bf16_e5m2, c10::BFloat16, c10::Float8_e5m2)
ENTRY(rope_store_f32_i8, float, int8_t)
ENTRY(rope_store_bf16_i8, c10::BFloat16, int8_t)
