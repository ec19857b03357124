// The compiled step's CPU ops as dispatcher kernels over moe.cpp, sinkhorn.cpp, indexer_topk.cpp
// and sink_attention_rows.cpp (compiled before it, one translation unit); built by step_ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <array>
#include <mutex>
#include <unordered_map>

namespace {

// MOE_*, INDEXER_THREADED_WORK and SINK_ATTENTION_THREADED_WORK come from Python as -D flags
// (step_ops.py's ``_defines``): cpu/moe.py's size limits and the Python ops' thread thresholds.
constexpr int64_t kMaxRows = MOE_MAX_ROWS;
constexpr int64_t kSmallBytes = MOE_SMALL_EXPERT_BYTES, kMaxRowsSmall = MOE_MAX_ROWS_SMALL_EXPERTS;
constexpr int64_t kTinyBytes = MOE_TINY_EXPERT_BYTES, kMaxRowsTiny = MOE_MAX_ROWS_TINY_EXPERTS;
constexpr int64_t kThreadedWork = int64_t(1) << 17;  // n_tok * k * inter * d from which threads pay
constexpr int64_t kIndexerThreadedWork = INDEXER_THREADED_WORK;  // t * e * h * d from which threads pay
constexpr int64_t kSinkAttentionThreadedWork = SINK_ATTENTION_THREADED_WORK;  // t * l * h * d
constexpr int64_t kRopeThreadedElements = int64_t(1) << 15;  // elements of x from which threads pay

int64_t transposed_rows(const at::Tensor& w1) {
  const int64_t nbytes = w1.size(1) * w1.size(2) * int64_t(sizeof(float));
  if (nbytes <= kTinyBytes) return kMaxRowsTiny;
  return nbytes <= kSmallBytes ? kMaxRowsSmall : 0;
}

int64_t version_of(const at::Tensor& t) { return t.is_inference() ? -1 : int64_t(t._version()); }

struct Transposed {
  // the stacked weights, not kept alive (a weak reference keeps a TensorImpl's memory until
  // the entry is swept, so no other tensor is found under its address meanwhile)
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> owners;  // w1, w2, w3
  std::array<int64_t, 3> versions;
  std::array<const void*, 3> data;
  std::array<std::vector<int64_t>, 3> sizes;
  at::Tensor w13t, w2t;  // [E, d, 2I] gate | up columns, [E, I, d]
};

std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, Transposed> registry;

bool current(const Transposed& entry, const std::array<const at::Tensor*, 3>& w) {
  for (int i = 0; i < 3; ++i) {
    auto owner = entry.owners[i].lock();
    if (owner.get() != w[i]->unsafeGetTensorImpl() || entry.versions[i] != version_of(*w[i]) ||
        entry.data[i] != w[i]->data_ptr() || w[i]->sizes() != c10::IntArrayRef(entry.sizes[i]))
      return false;
  }
  return true;
}

std::pair<at::Tensor, at::Tensor> transposed(const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3) {
  const std::array<const at::Tensor*, 3> w{&w1, &w2, &w3};
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(w1.unsafeGetTensorImpl());
  if (it != registry.end() && current(it->second, w)) return {it->second.w13t, it->second.w2t};
  for (auto e = registry.begin(); e != registry.end();)  // drop the copies of freed weights
    e = e->second.owners[0].expired() ? registry.erase(e) : std::next(e);
  Transposed entry;
  for (int i = 0; i < 3; ++i) {
    entry.owners.emplace_back(w[i]->getIntrusivePtr());
    entry.versions[i] = version_of(*w[i]);
    entry.data[i] = w[i]->data_ptr();
    entry.sizes[i] = w[i]->sizes().vec();
  }
  entry.w13t = at::cat({w1, w3}, 1).transpose(1, 2).contiguous();
  entry.w2t = w2.transpose(1, 2).contiguous();
  auto out = std::make_pair(entry.w13t, entry.w2t);
  registry.insert_or_assign(w1.unsafeGetTensorImpl(), std::move(entry));
  return out;
}

bool experts_native(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3) {
  if (!x.device().is_cpu() || x.dim() != 2 || x.scalar_type() != at::kFloat || x.requires_grad()) return false;
  for (const at::Tensor* w : {&w1, &w2, &w3})
    if (!w->device().is_cpu() || w->scalar_type() != at::kFloat || !w->is_contiguous() || w->dim() != 3 ||
        w->requires_grad())
      return false;
  return x.size(0) <= std::max(kMaxRows, transposed_rows(w1));
}

at::Tensor routed_experts_cpu(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& ids_in,
                              const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3, double limit) {
  if (!experts_native(x_in, w1, w2, w3) || !weights_in.device().is_cpu() || !ids_in.device().is_cpu() ||
      weights_in.requires_grad()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepinfer::routed_experts", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x_in, weights_in, ids_in, w1, w2, w3, limit);
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n_tok = x.size(0), d = x.size(1), k = ids.size(1), inter = w1.size(1);
  at::Tensor out = at::empty_like(x);
  const int threads = n_tok * k * inter * d >= kThreadedWork ? at::get_num_threads() : 1;
  if (n_tok <= transposed_rows(w1)) {
    auto [w13t, w2t] = transposed(w1, w2, w3);
    routed_experts_small_f32(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(),
                             w13t.data_ptr<float>(), w2t.data_ptr<float>(), out.data_ptr<float>(), n_tok, k, d,
                             inter, float(limit), threads);
  } else {
    at::Tensor scratch = at::empty({n_tok * k, 3 * inter}, x.options());  // gate | up, then activations
    routed_experts_f32(x.data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), w1.data_ptr<float>(),
                       w2.data_ptr<float>(), w3.data_ptr<float>(), scratch.data_ptr<float>(), out.data_ptr<float>(),
                       n_tok, k, d, inter, float(limit), threads);
  }
  return out;
}

int64_t transposed_count() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto e = registry.begin(); e != registry.end();)
    e = e->second.owners[0].expired() ? registry.erase(e) : std::next(e);
  return static_cast<int64_t>(registry.size());
}

at::Tensor sinkhorn_cpu(const at::Tensor& comb, int64_t iters, double eps) {
  if (!comb.device().is_cpu() || comb.scalar_type() != at::kFloat || comb.dim() < 2 ||
      comb.size(-1) != comb.size(-2) || comb.requires_grad()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepinfer::sinkhorn", "")
                         .typed<at::Tensor(const at::Tensor&, int64_t, double)>();
    return op.call(comb, iters, eps);
  }
  const at::Tensor c = comb.contiguous();
  at::Tensor out = at::empty_like(c);
  const int64_t n = c.size(-1);
  if (c.numel() > 0) sinkhorn_f32(c.data_ptr<float>(), out.data_ptr<float>(), c.numel() / (n * n), n, iters, float(eps),
                 at::get_num_threads());
  return out;
}

std::tuple<at::Tensor, at::Tensor> indexer_topk_cpu(const at::Tensor& q, const at::Tensor& keys,
                                                    const at::Tensor& entry_idx, const at::Tensor& entry_valid,
                                                    const at::Tensor& weights, int64_t topk, double scale) {
  bool native = q.dim() == 3 && keys.dim() == 2 && entry_idx.dim() == 2 && entry_valid.dim() == 2 &&
                weights.dim() == 2 && entry_idx.sizes() == entry_valid.sizes() &&
                entry_idx.scalar_type() == at::kLong && entry_valid.scalar_type() == at::kBool &&
                q.size(0) == entry_idx.size(0) && weights.size(0) == q.size(0) && weights.size(1) == q.size(1) &&
                keys.size(1) == q.size(2);
  for (const at::Tensor* t : {&q, &keys, &weights})
    native = native && t->device().is_cpu() && t->scalar_type() == at::kFloat && !t->requires_grad();
  native = native && entry_idx.device().is_cpu() && entry_valid.device().is_cpu();
  if (!native) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepinfer::indexer_topk", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&, c10::SymInt,
                                                                   double)>();
    return op.call(q, keys, entry_idx, entry_valid, weights, c10::SymInt(topk), scale);
  }
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), wc = weights.contiguous();
  const at::Tensor idx = entry_idx.contiguous(), valid = entry_valid.contiguous();
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), e = idx.size(1);
  at::Tensor rows = at::empty({t, topk}, idx.options());
  at::Tensor picked = at::empty({t, topk}, valid.options());
  if (t == 0 || topk == 0) return {rows, picked};
  const int threads = t * e * h * d >= kIndexerThreadedWork ? at::get_num_threads() : 1;
  const int64_t bad = indexer_topk_f32(qc.data_ptr<float>(), kc.data_ptr<float>(), idx.data_ptr<int64_t>(),
                                       valid.data_ptr<bool>(), wc.data_ptr<float>(), rows.data_ptr<int64_t>(),
                                       picked.data_ptr<bool>(), t, h, d, e, kc.size(0), topk, float(scale), threads);
  TORCH_CHECK_INDEX(bad == 0, "indexer_topk: ", bad, " visible entries index outside the key pool of ", kc.size(0),
                    " rows");
  return {rows, picked};
}

// Interleaved RoPE (models/layers/rope.py ``apply_rope``) on fp32 rows: the last 2 * half
// channels of each row of x rotate in adjacent pairs, out[2i] = e c - o s, out[2i + 1] =
// o c + e s, the others are copied. cos / sin hold one row of `half` values per token
// (broadcast over x's middle dims) or per row. Vector lanes hold whole pairs: a pair-swapping
// permute gives (o, e), and x * (c, c) + swapped * (-s, s) rounds each product and the sum as
// the Python formula does (no contraction: Inductor's flags), so the bits match it.
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool shaped = x.dim() >= 2 && cos.dim() == x.dim() && cos.sizes() == sin.sizes() &&
                      2 * cos.size(-1) <= x.size(-1) && cos.size(0) == x.size(0);
  bool per_token = shaped, per_row = shaped;
  for (int64_t d = 1; shaped && d + 1 < x.dim(); ++d) {
    per_token = per_token && cos.size(d) == 1;
    per_row = per_row && cos.size(d) == x.size(d);
  }
  bool native = per_token || per_row;
  for (const at::Tensor* t : {&x, &cos, &sin})
    native = native && t->device().is_cpu() && t->scalar_type() == at::kFloat && !t->requires_grad();
  if (!native) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepinfer::rope", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return op.call(x, cos, sin);
  }
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t d = x.size(-1), half = cos.size(-1), rd = 2 * half, keep = d - rd;
  if (xc.numel() == 0) return out;
  const int64_t rows = xc.numel() / d;
  const int64_t per = per_row ? 1 : rows / x.size(0);  // rows sharing one token's cos / sin
  const float *xp = xc.data_ptr<float>(), *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int threads = rows * d >= kRopeThreadedElements ? at::get_num_threads() : 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> c2(rd), s2(rd);  // (c, c) and (-s, s) per pair, for the current token
    int64_t have = -1;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / per;
      if (t != have) {
        for (int64_t i = 0; i < half; ++i) {
          c2[2 * i] = c2[2 * i + 1] = cp[t * half + i];
          s2[2 * i] = -sp[t * half + i];
          s2[2 * i + 1] = sp[t * half + i];
        }
        have = t;
      }
      const float* xr = xp + r * d;
      float* yr = op + r * d;
      std::copy_n(xr, keep, yr);
      const float* xq = xr + keep;
      float* yq = yr + keep;
      int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
      for (; j + 16 <= rd; j += 16) {
        const __m512 v = _mm512_loadu_ps(xq + j);
        const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (o, e) in every pair
        _mm512_storeu_ps(yq + j, _mm512_add_ps(_mm512_mul_ps(v, _mm512_loadu_ps(c2.data() + j)),
                                               _mm512_mul_ps(swapped, _mm512_loadu_ps(s2.data() + j))));
      }
#elif defined(CPU_CAPABILITY_AVX2)
      for (; j + 8 <= rd; j += 8) {
        const __m256 v = _mm256_loadu_ps(xq + j);
        const __m256 swapped = _mm256_permute_ps(v, 0xB1);
        _mm256_storeu_ps(yq + j, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c2.data() + j)),
                                               _mm256_mul_ps(swapped, _mm256_loadu_ps(s2.data() + j))));
      }
#endif
      for (; j < rd; j += 2) {
        const float e = xq[j], o = xq[j + 1], c = c2[j], s = s2[j + 1];
        yq[j] = e * c - o * s;
        yq[j + 1] = o * c + e * s;
      }
    }
  }
  return out;
}

// A RoPE table the kernel takes: fp32 CPU [T, 1, half] (one row per token, broadcast over the
// heads) with 2 * half <= d, its sin the same shape; or neither given.
bool per_token_rope(const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, int64_t t, int64_t d) {
  if (!cos.has_value() && !sin.has_value()) return true;
  if (!cos.has_value() || !sin.has_value() || cos->sizes() != sin->sizes()) return false;
  const at::Tensor& c = *cos;
  bool ok = c.dim() == 3 && c.size(1) == 1 && c.size(0) == t && 2 * c.size(2) <= d;
  for (const at::Tensor* x : {&*cos, &*sin})
    ok = ok && x->device().is_cpu() && x->scalar_type() == at::kFloat && !x->requires_grad();
  return ok;
}

at::Tensor sink_attention_rows_cpu(const at::Tensor& q, const at::Tensor& pool0, const at::Tensor& idx0,
                                   const at::Tensor& visible0, const std::optional<at::Tensor>& pool1,
                                   const std::optional<at::Tensor>& idx1, const std::optional<at::Tensor>& visible1,
                                   const at::Tensor& sink, double scale, const std::optional<at::Tensor>& q_cos,
                                   const std::optional<at::Tensor>& q_sin, const std::optional<at::Tensor>& out_cos,
                                   const std::optional<at::Tensor>& out_sin) {
  const bool two = pool1.has_value();
  const auto part_ok = [&q](const at::Tensor& pool, const at::Tensor& idx, const at::Tensor& vis) {
    return pool.dim() == 2 && pool.size(1) == q.size(2) && pool.scalar_type() == at::kFloat &&
           pool.device().is_cpu() && !pool.requires_grad() && idx.dim() == 2 && idx.size(0) == q.size(0) &&
           idx.scalar_type() == at::kLong && idx.device().is_cpu() && vis.sizes() == idx.sizes() &&
           vis.scalar_type() == at::kBool && vis.device().is_cpu();
  };
  bool native = q.dim() == 3 && sink.dim() == 1 && sink.size(0) == q.size(1) && two == idx1.has_value() &&
                two == visible1.has_value();
  for (const at::Tensor* t : {&q, &sink})
    native = native && t->device().is_cpu() && t->scalar_type() == at::kFloat && !t->requires_grad();
  native = native && part_ok(pool0, idx0, visible0) && (!two || part_ok(*pool1, *idx1, *visible1)) &&
           per_token_rope(q_cos, q_sin, q.size(0), q.size(2)) && per_token_rope(out_cos, out_sin, q.size(0), q.size(2));
  if (!native) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("deepinfer::sink_attention_rows", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, const at::Tensor&, double,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
    return op.call(q, pool0, idx0, visible0, pool1, idx1, visible1, sink, scale, q_cos, q_sin, out_cos, out_sin);
  }
  const at::Tensor qc = q.contiguous(), sc = sink.contiguous();
  const at::Tensor p0 = pool0.contiguous(), i0 = idx0.contiguous(), v0 = visible0.contiguous();
  at::Tensor p1, i1, v1;
  if (two) p1 = pool1->contiguous(), i1 = idx1->contiguous(), v1 = visible1->contiguous();
  at::Tensor qcos, qsin, ocos, osin;  // [T, half] contiguous where given
  if (q_cos.has_value()) qcos = q_cos->contiguous(), qsin = q_sin->contiguous();
  if (out_cos.has_value()) ocos = out_cos->contiguous(), osin = out_sin->contiguous();
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), l0 = i0.size(1), l1 = two ? i1.size(1) : 0;
  at::Tensor out = at::empty({t, h, d}, qc.options());
  if (t == 0 || h == 0 || d == 0) return out;
  const int threads = t * (l0 + l1) * h * d >= kSinkAttentionThreadedWork ? at::get_num_threads() : 1;
  const int64_t bad = sink_attention_rows_f32(
      qc.data_ptr<float>(), p0.data_ptr<float>(), i0.data_ptr<int64_t>(), v0.data_ptr<bool>(), p0.size(0), l0,
      two ? p1.data_ptr<float>() : nullptr, two ? i1.data_ptr<int64_t>() : nullptr, two ? v1.data_ptr<bool>() : nullptr,
      two ? p1.size(0) : 0, l1, sc.data_ptr<float>(), out.data_ptr<float>(), t, h, d, float(scale),
      qcos.defined() ? qcos.data_ptr<float>() : nullptr, qsin.defined() ? qsin.data_ptr<float>() : nullptr,
      qcos.defined() ? qcos.size(-1) : 0, ocos.defined() ? ocos.data_ptr<float>() : nullptr,
      osin.defined() ? osin.data_ptr<float>() : nullptr, ocos.defined() ? ocos.size(-1) : 0, threads);
  TORCH_CHECK_INDEX(bad == 0, "sink_attention_rows: ", bad, " visible keys index outside their pool");
  return out;
}

}  // namespace

// The ops' C shims: a compiled step's C++ wrapper calls them by name (Inductor's
// ``custom_ops_to_c_shims``), the kernels without the dispatcher's schema lookup and boxing.
// Inductor's calling convention: tensors as handles (an optional one as a pointer to its handle
// or null), ints as int64_t, floats as double, each result through a ``ret`` pointer.
// step_ops.py declares these signatures to the wrapper as written here (``build.c_shims``).
extern "C" AOTITorchError aoti_torch_cpu_routed_experts_cpu(AtenTensorHandle x, AtenTensorHandle weights,
    AtenTensorHandle ids, AtenTensorHandle w1, AtenTensorHandle w2, AtenTensorHandle w3, double limit,
    AtenTensorHandle* ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(routed_experts_cpu(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weights),
        *tensor_handle_to_tensor_pointer(ids), *tensor_handle_to_tensor_pointer(w1),
        *tensor_handle_to_tensor_pointer(w2), *tensor_handle_to_tensor_pointer(w3), limit));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_sinkhorn_cpu(AtenTensorHandle comb, int64_t iters, double eps,
    AtenTensorHandle* ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(sinkhorn_cpu(*tensor_handle_to_tensor_pointer(comb), iters, eps));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_rope_cpu(AtenTensorHandle x, AtenTensorHandle cos, AtenTensorHandle sin,
    AtenTensorHandle* ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(rope_cpu(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(cos),
                                       *tensor_handle_to_tensor_pointer(sin)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_sink_attention_rows_cpu(AtenTensorHandle q, AtenTensorHandle pool0,
    AtenTensorHandle idx0, AtenTensorHandle visible0, AtenTensorHandle* pool1, AtenTensorHandle* idx1,
    AtenTensorHandle* visible1, AtenTensorHandle sink, double scale, AtenTensorHandle* q_cos, AtenTensorHandle* q_sin,
    AtenTensorHandle* out_cos, AtenTensorHandle* out_sin, AtenTensorHandle* ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(sink_attention_rows_cpu(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(pool0),
        *tensor_handle_to_tensor_pointer(idx0), *tensor_handle_to_tensor_pointer(visible0),
        pointer_to_optional<at::Tensor>(pool1), pointer_to_optional<at::Tensor>(idx1),
        pointer_to_optional<at::Tensor>(visible1), *tensor_handle_to_tensor_pointer(sink), scale,
        pointer_to_optional<at::Tensor>(q_cos), pointer_to_optional<at::Tensor>(q_sin),
        pointer_to_optional<at::Tensor>(out_cos), pointer_to_optional<at::Tensor>(out_sin)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_indexer_topk_cpu(AtenTensorHandle q, AtenTensorHandle keys,
    AtenTensorHandle entry_idx, AtenTensorHandle entry_valid, AtenTensorHandle weights, int64_t topk, double scale,
    AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto [rows, picked] = indexer_topk_cpu(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(keys),
        *tensor_handle_to_tensor_pointer(entry_idx), *tensor_handle_to_tensor_pointer(entry_valid),
        *tensor_handle_to_tensor_pointer(weights), topk, scale);
    *ret0 = new_tensor_handle(std::move(rows));
    *ret1 = new_tensor_handle(std::move(picked));
  });
}

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("routed_experts_cpu(Tensor x, Tensor weights, Tensor ids, Tensor w1, Tensor w2, Tensor w3, float limit) -> Tensor");
  m.def("sinkhorn_cpu(Tensor comb, int iters, float eps) -> Tensor");
  m.def("rope_cpu(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("routed_experts_transposed_count() -> int");
  m.def(
      "indexer_topk_cpu(Tensor q, Tensor keys, Tensor entry_idx, Tensor entry_valid, Tensor weights, int topk, "
      "float scale) -> (Tensor, Tensor)");
  m.def(
      "sink_attention_rows_cpu(Tensor q, Tensor pool0, Tensor idx0, Tensor visible0, Tensor? pool1, Tensor? idx1, "
      "Tensor? visible1, Tensor sink, float scale, Tensor? q_cos=None, Tensor? q_sin=None, Tensor? out_cos=None, "
      "Tensor? out_sin=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CompositeExplicitAutograd, m) {
  m.impl("routed_experts_cpu", &routed_experts_cpu);
  m.impl("sinkhorn_cpu", &sinkhorn_cpu);
  m.impl("rope_cpu", &rope_cpu);
  m.impl("routed_experts_transposed_count", &transposed_count);
  m.impl("indexer_topk_cpu", &indexer_topk_cpu);
  m.impl("sink_attention_rows_cpu", &sink_attention_rows_cpu);
}
