"""Batch-invariant matrix products on the CPU (``batch_invariant``'s engine steps and research
forward): while ``invariant_products()`` is active, every fp32 ``mm``, ``addmm``, ``bmm``,
``baddbmm`` and ``mv`` on CPU tensors runs the packed kernel (``cpu_packed_gemm``), whose
every output is one FMA chain over the inner dimension, the same whatever the row and column
counts; elementwise transcendental ops and softmaxes run so that no element's result depends
on the tensor's size (``_aligned``, ``_softmax``). BLAS kernels pick their blocking, and so their summation order, by shape: a token's
result would then depend on how many tokens share the product, and the engine's decode rows
would differ in the last bits from a trainer's forward over the whole sequence.

The mode intercepts aten calls below autograd (a ``TorchDispatchMode``), so composite ops
(``F.linear``, ``matmul``, ``einsum``) and backward products are covered alike; it costs a
Python call per aten op and a packing of the right-hand matrix per product. vLLM's
batch-invariant mode replaces the same products with its own kernels on CUDA (its
``batch_invariant`` module); this is that idea on the CPU kernels built here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from deepinfer.kernels.cpu import packed_gemm as cpu_packed_gemm
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def invariant_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for ``a`` [M, K], ``b`` [K, N] on the packed kernel (fp32 sums)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        out = a.new_zeros(m, n)
        return out if bias is None else out + bias
    if k == 0:
        out = a.new_zeros(m, n)
        return out + bias if bias is not None else out
    packed = cpu_packed_gemm.pack(b.t().float())
    flat_bias = None if bias is None else bias.float().expand(n).contiguous() if bias.dim() <= 1 else None
    out = cpu_packed_gemm.gemm(a.float().contiguous(), packed, n, flat_bias)
    if bias is not None and flat_bias is None:
        out = out + bias  # a bias of whole rows (addmm's broadcast form)
    return out.to(a.dtype)


def _scaled(out: torch.Tensor, base: torch.Tensor | None, beta: Any, alpha: Any) -> torch.Tensor:
    if alpha != 1:
        out = out * alpha
    if base is None or beta == 0:
        return out
    return out + (base if beta == 1 else base * beta)


def _mm(a, b):
    return invariant_mm(a, b)


def _addmm(base, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and base.dim() <= 1:
        return invariant_mm(a, b, base)
    return _scaled(invariant_mm(a, b), base, beta, alpha)


def _bmm(a, b):
    return (
        torch.stack([invariant_mm(x, y) for x, y in zip(a, b, strict=True)])
        if len(a)
        else a.new_zeros(0, a.shape[1], b.shape[2])
    )


def _baddbmm(base, a, b, *, beta=1, alpha=1):
    return _scaled(_bmm(a, b), base, beta, alpha)


def _mv(a, v):
    return invariant_mm(a, v.unsqueeze(1)).squeeze(1)


# Elementwise transcendental ops run a vector loop and a scalar tail, whose results can differ
# in the last bit (the vector exp is not the C library's): which elements fall in the tail
# depends on the tensor's size, so a token's value would depend on how many share the call.
# Under the mode they run on a buffer padded to a multiple of ``_ALIGN`` elements (a multiple
# of every vector width and of the threads' shares), so every element takes the vector path.
_ALIGN = 1024
_ELEMENTWISE_NAMES = (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid", "silu", "tanh", "erf", "softplus",
    "gelu", "rsqrt", "sin", "cos",
)  # fmt: skip
_ELEMENTWISE = {getattr(aten, n).default for n in _ELEMENTWISE_NAMES} | {aten.pow.Tensor_Scalar}
_IN_PLACE = {
    getattr(aten, n + "_").default: getattr(aten, n).default
    for n in _ELEMENTWISE_NAMES
    if hasattr(aten, n + "_")
}


def _aligned(func: Any, x: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """``func(x, ...)`` computed on ``x`` flattened and zero-padded to a multiple of ``_ALIGN``."""
    n = x.numel()
    flat = x.reshape(-1)
    pad = -n % _ALIGN
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    return func(flat, *rest, **kwargs)[:n].view(x.shape)


def _softmax(func: Any, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """A softmax over any dim as one over contiguous last-dim rows (each row then runs the same
    loop whatever the row count)."""
    moved = x.movedim(dim, -1).contiguous()
    return func(moved, -1, half_to_float).movedim(-1, dim).contiguous()


_PRODUCTS = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten.mv.default: _mv,
}


class _InvariantProducts(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _PRODUCTS.get(func)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_cpu = first is not None and first.device.type == "cpu" and first.is_floating_point()
        if handler is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
                return handler(*args, **kwargs)
        elif on_cpu and func in _ELEMENTWISE:
            return _aligned(func, *args, **kwargs)
        elif on_cpu and func in _IN_PLACE:
            return args[0].copy_(_aligned(_IN_PLACE[func], *args, **kwargs))
        elif on_cpu and func in (aten._softmax.default, aten._log_softmax.default):
            return _softmax(func, *args, **kwargs)
        elif _composite(func):  # under inference mode ``linear`` and ``matmul`` arrive whole
            with self:
                return func.decompose(*args, **kwargs)
        return func(*args, **kwargs)


def _composite(func: Any) -> bool:
    """Whether ``func`` is defined by other aten ops (whose products the mode then sees)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


_STATE = threading.local()


def active() -> bool:
    """Whether this thread is inside ``invariant_products``: the C++ kernels that choose a
    faster summation order (norms, attention, Sinkhorn, MoE) then step aside for the plain
    form the research forward computes."""
    return getattr(_STATE, "depth", 0) > 0


def available() -> bool:
    """Whether the packed kernel built here (without it the mode changes nothing)."""
    return cpu_packed_gemm.available()


@contextlib.contextmanager
def invariant_products(enabled: bool = True) -> Iterator[None]:
    """fp32 CPU matrix products on the packed kernel inside the block (``enabled=False``:
    nothing changes, for callers that decide per call)."""
    if not enabled or not available():
        yield
        return
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        with _InvariantProducts():
            yield
    finally:
        _STATE.depth -= 1
