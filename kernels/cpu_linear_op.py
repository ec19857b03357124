"""``deepinfer::packed_linear``: a compiled CPU step's projections on packed weight copies, as a
C++ op registered with PyTorch's dispatcher.

A tiny-V4 step runs 66 small projections (K = 32-256, N = 8-258). Inside the compiled step
each was ``aten::mm`` / ``addmm`` on MKL, where ``cpu_packed_gemm``'s kernel on a packed copy
takes about half the time (benchmarks/RESULTS.md). A Python custom op would give the gain back
in its per-call Python dispatch, so this op's CPU kernel is C++: the compiled step's C++ wrapper reaches it without
taking the GIL, through its C shim (``c_shims``; the dispatcher where no shim is declared).

``register(weight)`` packs a weight once into a registry owned by the library, keyed by the
weight's tensor and checked at every call against it (alive, same version counter, storage,
sizes and strides: an in-place write through PyTorch or ``p.data = t`` invalidates the
copy). Writes PyTorch does not count (through ``p.data.copy_``, or raw pointers) need a fresh
``register``; the engine writes none into these weights. ``packed_linear(x, weight, bias)``
multiplies on the packed copy when one is registered and current (an fp32 bias added in the
kernel), and is ``aten::mm`` / ``aten::addmm`` otherwise, so a graph that calls it is correct
whatever was registered; only the speed differs. Each output is the packed kernel's single FMA chain over k, the same at any
row count (batch-invariant), another summation order than MKL's.

Built once per machine by ``cpu_build.load_op_library`` (PyTorch's extension builder) for the
vector ISA Inductor picks; ``available()`` is false where no compiler works, and the compile
pass that inserts the op then leaves ``mm`` alone."""

from __future__ import annotations

import torch
from deepinfer.kernels import cpu_build, cpu_packed_gemm

_OP_SOURCE = r"""
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
extern "C" PACKED_LINEAR_SHIM {
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
"""


# The C shim's signature (Inductor's calling convention: tensors as handles, an optional one
# as a pointer to its handle or null, the result through ``ret0``), written into the source
# and declared to the compiled step's wrapper by ``c_shims``.
_SHIM = (
    "AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle weight, "
    "AtenTensorHandle* bias, AtenTensorHandle* ret0)"
)


def _source() -> str:
    # the packed kernel's own source first: the op calls its packed_gemm_f32 and width V
    return cpu_packed_gemm._SOURCE + _OP_SOURCE.replace("PACKED_LINEAR_SHIM", _SHIM)


def _register_fakes() -> None:
    @torch.library.register_fake("deepinfer::packed_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])


def available() -> bool:
    """Whether the op is registered in this process (built, or loaded from the extension
    cache, on the first call; False where that fails)."""
    return cpu_build.load_op_library(
        "deepinfer_packed_linear",
        _source,
        _register_fakes,
        "the packed-linear CPU op is unavailable; compiled steps keep aten::mm",
    )


def c_shims() -> dict:
    """``aot_inductor.custom_ops_to_c_shims`` for this op where it is registered (its C shim's
    symbol is then global), else empty: a compiled step's wrapper then calls the shim directly."""
    return {torch.ops.deepinfer.packed_linear.default: [_SHIM]} if available() else {}


def register(weight: torch.Tensor) -> None:
    """Pack ``weight`` (2-D fp32, CPU) for ``packed_linear``; again after it was written in place."""
    if not available():
        raise RuntimeError("the packed-linear CPU op did not build on this machine")
    torch.ops.deepinfer.register_packed_linear(weight)


def registered() -> int:
    """Packed copies the registry holds, after dropping those of freed weights."""
    return int(torch.ops.deepinfer.packed_linear_count()) if available() else 0


def packed_calls() -> int:
    """Calls of the op so far (this process) that ran on a packed copy."""
    return int(torch.ops.deepinfer.packed_linear_calls()) if available() else 0


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` [M, K]: on ``weight``'s packed copy where one is
    registered and current, else ``aten::mm`` / ``aten::addmm``."""
    if not available():
        return x @ weight.T if bias is None else torch.addmm(bias, x, weight.T)
    return torch.ops.deepinfer.packed_linear(x, weight, bias)
