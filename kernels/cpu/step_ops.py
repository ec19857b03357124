"""The compiled step's opaque CPU ops as C++ dispatcher kernels: ``deepinfer::routed_experts_cpu``,
``deepinfer::sinkhorn_cpu``, ``deepinfer::indexer_topk_cpu`` and ``deepinfer::rope_cpu``.

``rope_cpu`` is ``deepinfer::rope``'s (``kernels/rope.py``, the interleaved RoPE a compiled
fp32 CPU step calls as one op) twin: vector lanes hold whole pairs where Inductor's loops read
and wrote the pairs' strided channels one element at a time (which shortens a long tiny-V4
prefill step; benchmarks/RESULTS.md), with the formula's bits.

``deepinfer::routed_experts``, ``deepinfer::sinkhorn`` and ``deepinfer::indexer_topk`` are
Python custom ops: inside a compiled step's C++ wrapper each call goes back into Python (the
custom-op machinery, dynamo's disable wrapper, the kernel choice in ``cpu.moe``, a ``ctypes``
call), 17 calls a tiny-V4 step. These ops run the same C++ kernels (``moe.cpp``,
``sinkhorn.cpp``, ``indexer_topk.cpp`` and ``sink_attention_rows.cpp``, compiled into this
extension before ``step_ops.cpp``) with the same choice of kernel and thread count, from C++,
so the wrapper reaches them without Python.
They are built with Inductor's floating-point flags, so they return the bits the Python
ops' ``ctypes`` builds return. Inputs the kernels do not take (another dtype or device,
autograd, steps too large for the expert kernels) go to the Python op through the
dispatcher, so a graph that calls these ops is correct for any input; only the speed
differs. ``compile_passes.native_cpu_ops`` puts them into compiled CPU steps, whose C++
wrapper calls each through its C shim (``c_shims``) rather than the dispatcher. Every output
is contiguous, as the fakes say (the Python ops' too): those wrappers do not assert layouts.

The transposed expert copies the small-expert kernel reads are made once per stacked weight
and kept in a registry like ``linear_op``'s: keyed by ``w1``'s tensor and checked at every
call against all three weights (alive, version counter, storage, sizes), so an in-place write
through PyTorch makes a fresh copy."""

from __future__ import annotations

import torch
from deepinfer.kernels import indexer_topk, sink_attention_rows, sinkhorn
from deepinfer.kernels import moe as _moe  # noqa: F401  (registers the experts' fallback op)
from deepinfer.kernels import rope as _rope  # noqa: F401  (registers RoPE's fallback op)
from deepinfer.kernels.cpu import build, moe

# the kernels' own sources first (the ops call their C functions), then the ops
SOURCES = ("moe.cpp", "sinkhorn.cpp", "indexer_topk.cpp", "sink_attention_rows.cpp", "step_ops.cpp")


def c_shims() -> dict:
    """``aot_inductor.custom_ops_to_c_shims`` for these ops where they are registered (their C
    shims' symbols are then global), else empty: a compiled step's wrapper then calls the
    shims directly."""
    if not available():
        return {}
    return {
        getattr(torch.ops.deepinfer, op).default: [sig] for op, sig in build.c_shims("step_ops.cpp").items()
    }


def _defines() -> dict[str, int]:
    """The constants the sources take from Python: ``cpu.moe``'s size limits, the thread
    thresholds of the indexer and of the attention rows, and ``sinkhorn``'s block sizes."""
    return {
        "MOE_MAX_ROWS": moe.MAX_ROWS,
        "MOE_SMALL_EXPERT_BYTES": moe.SMALL_EXPERT_BYTES,
        "MOE_MAX_ROWS_SMALL_EXPERTS": moe.MAX_ROWS_SMALL_EXPERTS,
        "MOE_TINY_EXPERT_BYTES": moe.TINY_EXPERT_BYTES,
        "MOE_MAX_ROWS_TINY_EXPERTS": moe.MAX_ROWS_TINY_EXPERTS,
        "INDEXER_THREADED_WORK": indexer_topk.THREADED_WORK,
        "SINK_ATTENTION_THREADED_WORK": sink_attention_rows.THREADED_WORK,
        **sinkhorn.DEFINES,
    }


def _register_fakes() -> None:
    # every output contiguous, as the kernels and the Python ops they fall back to return it:
    # a compiled step's C++ wrapper runs without Inductor's size asserts
    # (``compilation.inductor_options``)
    @torch.library.register_fake("deepinfer::routed_experts_cpu")
    def _(x, weights, ids, w1, w2, w3, limit):
        return x.new_empty(x.shape)

    @torch.library.register_fake("deepinfer::sinkhorn_cpu")
    def _(comb, iters, eps):
        return comb.new_empty(comb.shape)

    @torch.library.register_fake("deepinfer::rope_cpu")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("deepinfer::indexer_topk_cpu")
    def _(q, keys, entry_idx, entry_valid, weights, topk, scale):
        shape = (entry_idx.shape[0], topk)
        return entry_idx.new_empty(shape, dtype=torch.long), entry_valid.new_empty(shape, dtype=torch.bool)

    @torch.library.register_fake("deepinfer::sink_attention_rows_cpu")
    def _(q, *_, **__):
        return q.new_empty(q.shape)


def available() -> bool:
    """Whether the ops are registered in this process (built on the first call). Their
    fallbacks, the Python ops, are registered by importing ``moe`` and ``sinkhorn`` (above)."""
    return build.load_op_library(
        "deepinfer_cpu_step_ops",
        SOURCES,
        _register_fakes,
        "the C++ step ops are unavailable; compiled steps keep the Python ops",
        build.INDUCTOR_MATH_FLAGS + build.define_flags(_defines()),
    )


def transposed_count() -> int:
    """Transposed expert copies the registry holds, after dropping those of freed weights."""
    return int(torch.ops.deepinfer.routed_experts_transposed_count()) if available() else 0
