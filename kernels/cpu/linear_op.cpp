// deepinfer::packed_linear, a dispatcher op over packed_gemm.cpp's kernel (compiled after it);
// built by linear_op.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Packed {
  // the registered weight, not kept alive; the weak reference keeps its TensorImpl's memory
  // until the entry is swept, so no other tensor can be found under its address meanwhile
  c10::weak_intrusive_ptr<c10::TensorImpl> owner;
  uint32_t version;  // its version counter when packed
  const void* data;  // its storage, sizes and strides when packed: ``p.data = t`` changes them
  std::vector<int64_t> sizes, strides;  // without a version bump
  at::Tensor packed;  // [ceil(N / 2V)][K][2V]
};

std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, Packed> registry;
std::atomic<int64_t> packed_calls{0};  // calls that ran on a packed copy (tests, logs)

void sweep() {  // drop the copies of freed weights (the registry's lock held)
  for (auto it = registry.begin(); it != registry.end();) {
    it = it->second.owner.expired() ? registry.erase(it) : std::next(it);
  }
}

bool current(const Packed& entry, const at::Tensor& weight) {
  if (weight.is_inference()) return false;  // no version counter: never registered
  auto owner = entry.owner.lock();
  return owner.get() == weight.unsafeGetTensorImpl() && entry.version == weight._version() &&
         entry.data == weight.data_ptr() && weight.sizes() == c10::IntArrayRef(entry.sizes) &&
         weight.strides() == c10::IntArrayRef(entry.strides);
}

void register_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "packed_linear: register a 2-D fp32 CPU weight, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(!weight.is_inference(), "packed_linear: an inference tensor has no version counter to check");
  const int64_t n = weight.size(0), k = weight.size(1), t = 2 * V, blocks = (n + t - 1) / t;
  at::Tensor padded = at::zeros({blocks * t, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight.detach());
  at::Tensor packed = padded.view({blocks, t, k}).transpose(1, 2).contiguous();
  std::lock_guard<std::mutex> lock(registry_mutex);
  sweep();
  registry.insert_or_assign(
      weight.unsafeGetTensorImpl(),
      Packed{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), weight._version(),
             weight.data_ptr(), weight.sizes().vec(), weight.strides().vec(), packed});
}

int64_t registered() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  sweep();
  return static_cast<int64_t>(registry.size());
}

int64_t calls() { return packed_calls.load(); }

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  at::Tensor packed;
  if (x.scalar_type() == at::kFloat && x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1)) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(weight.unsafeGetTensorImpl());
    if (it != registry.end() && current(it->second, weight)) packed = it->second.packed;
  }
  const bool fp32_bias = !bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                                 bias->size(0) == weight.size(0) && bias->device().is_cpu());
  if (!packed.defined() || !fp32_bias) return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  packed_calls.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = weight.size(0), k = xc.size(1);
  at::Tensor y = at::empty({m, n}, xc.options());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  packed_gemm_f32(xc.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), m, n, k, at::get_num_threads());
  return y;
}

}  // namespace

// The op's C shim: a compiled step's C++ wrapper calls it by name (Inductor's
// ``custom_ops_to_c_shims``), the kernel without the dispatcher's schema lookup and boxing.
// Inductor's calling convention: tensors as handles, an optional one as a pointer to its handle
// or null, the result through ``ret0``. linear_op.py declares this signature to the wrapper as
// written here (``build.c_shims``).
extern "C" AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle weight,
    AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(packed_linear(*tensor_handle_to_tensor_pointer(x),
                                            *tensor_handle_to_tensor_pointer(weight),
                                            pointer_to_optional<at::Tensor>(bias)));
  });
}

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("register_packed_linear(Tensor weight) -> ()");
  m.def("packed_linear_count() -> int");
  m.def("packed_linear_calls() -> int");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("register_packed_linear", &register_weight);
}

TORCH_LIBRARY_IMPL(deepinfer, CompositeExplicitAutograd, m) {
  m.impl("packed_linear_count", &registered);
  m.impl("packed_linear_calls", &calls);
}
