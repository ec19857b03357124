"""``deepinfer::packed_linear``: a compiled CPU step's projections on packed weight copies, as a
C++ op registered with PyTorch's dispatcher.

A tiny-V4 step runs 66 small projections (K = 32-256, N = 8-258). Inside the compiled step
each was ``aten::mm`` / ``addmm`` on MKL, where ``packed_gemm``'s kernel on a packed copy
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

Built once per machine by ``build.load_op_library`` (PyTorch's extension builder) for the
vector ISA Inductor picks; ``available()`` is false where no compiler works, and the compile
pass that inserts the op then leaves ``mm`` alone."""

from __future__ import annotations

import torch
from deepinfer.kernels.cpu import build

# the packed kernel's own source first: the op calls its packed_gemm_f32 and width V
SOURCES = ("packed_gemm.cpp", "linear_op.cpp")


def _register_fakes() -> None:
    @torch.library.register_fake("deepinfer::packed_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])


def available() -> bool:
    """Whether the op is registered in this process (built, or loaded from the extension
    cache, on the first call; False where that fails)."""
    return build.load_op_library(
        "deepinfer_packed_linear",
        SOURCES,
        _register_fakes,
        "the packed-linear CPU op is unavailable; compiled steps keep aten::mm",
    )


def c_shims() -> dict:
    """``aot_inductor.custom_ops_to_c_shims`` for this op where it is registered (its C shim's
    symbol is then global), else empty: a compiled step's wrapper then calls the shim directly."""
    if not available():
        return {}
    return {
        getattr(torch.ops.deepinfer, op).default: [sig] for op, sig in build.c_shims("linear_op.cpp").items()
    }


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
