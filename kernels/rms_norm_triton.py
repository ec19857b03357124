"""RMSNorm as one launch on CUDA: ``deepinfer::rms_norm``, and with the residual add before
it ``deepinfer::add_rms_norm``, with one Triton kernel for both.

In eager PyTorch a norm is five or six launches (cast, square, mean, add, rsqrt, multiply,
weight), each reading the whole activation; an eager CUDA decode step makes several per
layer. ``models/layers/norms.py`` calls this op on eager non-CPU steps; CPU steps, compiled
steps (Inductor fuses the plain form itself) and autograd keep the plain form. The op's
default implementation is that same plain form (``reference``), which every device without
the kernel runs. The kernel is defined at the first CUDA call, so CPU-only machines never
import Triton; it also runs under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
The fused add rounds the sum to x's dtype (added in fp32, as ATen's CUDA add is) and returns
it beside the norm of that rounded sum: the two values a decoder layer's ``x + residual`` and
its norm give.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepinfer.kernels.triton_support import triton_installed

# Longest row one program normalises (registers): longer rows run the reference.
MAX_DIM = 16384


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``models/layers/norms.py``'s formulas: with a weight, ``w * x * rsqrt(mean(x^2) + eps)``
    in fp32, cast back once; without, ``x * rsqrt(...)`` in x's dtype."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


@torch.library.custom_op("deepinfer::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] (fp32) or None -> the norm of each row, in x's dtype."""
    return reference(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


def add_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` and ``reference`` of it."""
    total = x + residual
    return total, reference(total, weight, eps)


@torch.library.custom_op("deepinfer::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., d] of one dtype, weight [d] (fp32) or None -> (x + residual, the
    norm of each of its rows), both contiguous."""
    total, normed = add_reference(x, residual, weight, eps)
    return total.contiguous(), normed.contiguous()


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def takes(x: torch.Tensor) -> bool:
    """Float rows of at most ``MAX_DIM`` (and Triton installed)."""
    return triton_installed() and x.is_floating_point() and x.dim() >= 1 and 0 < x.shape[-1] <= MAX_DIM


@rms_norm.register_kernel("cuda")
def _cuda(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if takes(x):
        return rms_norm_triton(x, weight, eps)
    return reference(x, weight, eps).contiguous()


@add_rms_norm.register_kernel("cuda")
def _add_cuda(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if takes(x) and residual.dtype == x.dtype and residual.shape == x.shape:
        return add_rms_norm_triton(x, residual, weight, eps)
    total, normed = add_reference(x, residual, weight, eps)
    return total.contiguous(), normed.contiguous()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm(
        x_ptr,
        r_ptr,
        w_ptr,
        sum_ptr,
        out_ptr,
        dim,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < dim
        x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # the sum in fp32, rounded to x's dtype: what the norm then reads
            r = tl.load(r_ptr + row * dim + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * dim + cols, x, mask=ok)
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / dim + eps)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            y = w * (xf * r)
        else:  # the multiply in x's dtype, as the plain form's
            y = xf * r.to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    return _rms_norm


def _launch(
    rows: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One program per row of ``rows`` [n, d] (contiguous): the sum (with a residual) and the
    norm."""
    import triton

    dim = rows.shape[-1]
    out = torch.empty_like(rows)
    total = None if residual is None else torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _kernel()[(rows.shape[0],)](
            rows,
            rows if residual is None else residual,
            rows if weight is None else weight.contiguous(),
            out if total is None else total,
            out,
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
        )
    return total, out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as ``deepinfer::rms_norm``: one program per row."""
    dim = x.shape[-1]
    _, out = _launch(x.reshape(-1, dim).contiguous(), None, weight, eps)
    return out.view(x.shape)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``deepinfer::add_rms_norm``: one program per row."""
    dim = x.shape[-1]
    rows, res = x.reshape(-1, dim).contiguous(), residual.reshape(-1, dim).contiguous()
    total, out = _launch(rows, res, weight, eps)
    assert total is not None
    return total.view(x.shape), out.view(x.shape)
