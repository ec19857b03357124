// A whole Llama layer stack's decode step, calling the other kernels through the entry points
// decode_stack.py hands it; built and called by decode_stack.py.

#include <cstdint>
#include <cstring>

using gemv_i4_t = void (*)(const float*, const uint8_t*, const float*, const float*, const float*, float*,
                           int64_t, int64_t, int64_t, int);
using norm_t = void (*)(const float*, const float*, const float*, float*, float*, int64_t, int64_t, float);
using silu_t = void (*)(const float*, float*, int64_t, int64_t);
using rope_t = void (*)(const float*, const float*, const float*, const int64_t*, void*, void*, float*,
                        int64_t, int64_t, int64_t, int64_t);
using attn_t = void (*)(const float*, const void*, const void*, const int64_t*, const int64_t*, const bool*,
                        float*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
using gemm_vnni_t = void (*)(const float*, const uint8_t*, const float*, float*, void*, int64_t, int64_t, int64_t,
                             int);
using packed_t = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int);
using span_attn_t = void (*)(const float*, const void*, const void*, const int64_t*, const int64_t*, float*,
                             int64_t, int64_t, int64_t, int64_t, float, int);
using packed_i8_t = void (*)(const float*, const int8_t*, const uint16_t*, const float*, float*, int64_t,
                             int64_t, int64_t, int);
using sgmv_t = void (*)(const float*, int64_t, const int64_t*, const int64_t*, const int64_t*, int64_t,
                        const float*, int64_t, int64_t, const float* const*, const int64_t*, float*, int64_t);

// served LoRA adapters' terms of one step: the adapter rows sorted by slot and each group's
// slot and start (lora.py's LoraStep), and per layer and projection (qkv, o, gate_up, down) the
// slot matrices as lora_sgmv_f32 reads them: A, rank, linears, their B pointers, their output
// widths, the total width (a zero A: no adapter of the step touches it)
struct Lora {
  const int64_t* table;  // [layers, 4 * LORA_FIELDS]
  const int64_t* rows;
  const int64_t* group_slot;
  const int64_t* group_start;
  int64_t groups;
  sgmv_t sgmv;
};
constexpr int64_t LORA_FIELDS = 6;

// y [M, out] += the step's adapter rows' terms of projection j of layer l, x [M, in]
static void add_lora(const Lora* lora, int64_t l, int64_t j, const float* x, int64_t in, float* y) {
  if (lora == nullptr) return;
  const int64_t* e = lora->table + (l * 4 + j) * LORA_FIELDS;
  if (e[0] == 0) return;
  lora->sgmv(x, in, lora->rows, lora->group_slot, lora->group_start, lora->groups,
             reinterpret_cast<const float*>(e[0]), e[1], e[2], reinterpret_cast<const float* const*>(e[3]),
             reinterpret_cast<const int64_t*>(e[4]), y, e[5]);
}

// the offset slot of an int4 weight packed for cpu_int4_vnni (no scale or offset arrays)
constexpr int64_t VNNI_PACKED = 1;
// the offset slot of an fp32 weight with a copy packed for cpu_packed_gemm (in the scale slot)
constexpr int64_t F32_PACKED = 2;
// the offset slot of int8 weights packed for cpu_packed_gemm (their packed fp16 group scales in
// the scale slot)
constexpr int64_t I8_PACKED = 3;

struct Fns {
  gemv_i4_t gemv_i4;
  gemm_vnni_t gemm_vnni;
  packed_t packed;
  packed_i8_t packed_i8;
  void* scratch;  // cpu_int4_vnni's quantized activations
  int threads;
  // y [M, N] = x [M, K] @ W.T (+ bias): fp32 W through its packed copy (c = F32_PACKED, the copy
  // in the scale slot); packed int8 W with its packed group scales (c = I8_PACKED, s set); int4 W packed
  // for VNNI (c = VNNI_PACKED); or int4 W with a scale and offset per group of 32 (s and c set)
  void proj(const int64_t* t, int i, const float* x, float* y, int64_t M, int64_t N, int64_t K) const {
    const auto* b = reinterpret_cast<const float*>(t[i + 1]);
    const auto* s = reinterpret_cast<const float*>(t[i + 2]);
    const auto* c = reinterpret_cast<const float*>(t[i + 3]);
    if (t[i + 3] == F32_PACKED) packed(x, s, b, y, M, N, K, threads);
    else if (t[i + 3] == I8_PACKED) packed_i8(x, reinterpret_cast<const int8_t*>(t[i]), reinterpret_cast<const uint16_t*>(t[i + 2]), b, y, M, N, K, threads);
    else if (t[i + 3] == VNNI_PACKED) gemm_vnni(x, reinterpret_cast<const uint8_t*>(t[i]), b, y, scratch, M, N, K, threads);
    else gemv_i4(x, reinterpret_cast<const uint8_t*>(t[i]), s, c, b, y, M, N, K, threads);
  }
};

// fns: gemv_i4, add_rms_norm, silu_mul, rope_store, decode_attention (for the
// pools' dtype), gemm_i4_i8 (0 without VNNI), packed_gemm_f32, packed_gemm_i8,
// prefill_attention (for the pools' dtype: the step's prefill spans). lora: the step's adapter
// terms (null: none). table [layers,
// 20]: norm1 w, (qkv, o, gate_up, down) x (w, bias, scale or packed copy, int4 offset or a
// marker: VNNI_PACKED, F32_PACKED, I8_PACKED), norm2 w, k pool, v pool (0 for an absent bias,
// scale or offset).
extern "C" void llama_decode_stack(const int64_t* fns, const int64_t* table, int64_t layers, float* h,
                                   float* work, const float* cos, const float* sin,
                                   const int64_t* write_rows, const int64_t* dec_rows,
                                   const int64_t* dec_kv, const bool* dec_valid, int64_t M, int64_t D,
                                   int64_t H, int64_t KV, int64_t HD, int64_t I, int64_t n_dec,
                                   int64_t len_dec, float eps, float scale, void* scratch,
                                   const int64_t* spans, const int64_t* span_rows, int64_t n_spans, int threads,
                                   const Lora* lora) {
  const Fns f{reinterpret_cast<gemv_i4_t>(fns[0]), reinterpret_cast<gemm_vnni_t>(fns[5]),
              reinterpret_cast<packed_t>(fns[6]), reinterpret_cast<packed_i8_t>(fns[7]), scratch, threads};
  const auto norm = reinterpret_cast<norm_t>(fns[1]);
  const auto silu = reinterpret_cast<silu_t>(fns[2]);
  const auto rope = reinterpret_cast<rope_t>(fns[3]);
  const auto attn = reinterpret_cast<attn_t>(fns[4]);
  const auto span_attn = reinterpret_cast<span_attn_t>(fns[8]);
  const int64_t QKV = (H + 2 * KV) * HD, A = H * HD;
  float* normed = work;
  float* qkv = normed + M * D;
  float* q = qkv + M * QKV;
  float* att = q + M * A;  // M + 1 rows: the last takes padded decode rows
  float* o = att + (M + 1) * A;
  float* res = o + M * D;
  float* gu = res + M * D;
  float* act = gu + M * 2 * I;
  float* down = act + M * I;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* t = table + l * 20;
    const auto* norm1 = reinterpret_cast<const float*>(t[0]);
    const auto* norm2 = reinterpret_cast<const float*>(t[17]);
    void* k_pool = reinterpret_cast<void*>(t[18]);
    void* v_pool = reinterpret_cast<void*>(t[19]);
    norm(h, nullptr, norm1, h, normed, M, D, eps);
    f.proj(t, 1, normed, qkv, M, QKV, D);
    add_lora(lora, l, 0, normed, D, qkv);
    rope(qkv, cos, sin, write_rows, k_pool, v_pool, q, M, H, KV, HD);
    std::memset(att, 0, sizeof(float) * (M + 1) * A);
    attn(q, k_pool, v_pool, dec_rows, dec_kv, dec_valid, att, n_dec, len_dec, H, KV, HD, scale, threads);
    if (n_spans) span_attn(q, k_pool, v_pool, spans, span_rows, att, n_spans, H, KV, HD, scale, threads);
    f.proj(t, 5, att, o, M, D, A);
    add_lora(lora, l, 1, att, A, o);
    norm(h, o, norm2, res, normed, M, D, eps);
    f.proj(t, 9, normed, gu, M, 2 * I, D);
    add_lora(lora, l, 2, normed, D, gu);
    silu(gu, act, M, I);
    f.proj(t, 13, act, down, M, D, I);
    add_lora(lora, l, 3, act, I, down);
    for (int64_t i = 0; i < M * D; ++i) h[i] = res[i] + down[i];
  }
}
