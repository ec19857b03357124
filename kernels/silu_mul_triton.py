"""SwiGLU's ``silu(gate) * up`` as one launch on CUDA: ``deepinfer::silu_and_mul``, with a
Triton kernel.

In eager PyTorch the activation is two launches (``silu``, then the product), the first
writing a whole [T, I] intermediate the second reads back. Here one program per tile of a
row's ``I`` columns loads the row's gate and up halves of the fused projection's output,
computes ``silu`` in fp32 and rounds it to the activations' dtype before the product (as the
two ATen calls round between them), and writes the product once. The op's default
implementation is the plain form (``reference``), which every device without the kernel runs.
The kernel is defined at the first CUDA call, so CPU-only machines never import Triton; it
also runs under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from deepinfer.kernels.triton_support import triton_installed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # columns per program


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``models/layers/dispatch.py``'s plain form: ``silu(gate) * up`` of ``[gate, up]``
    side by side on the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("deepinfer::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] -> [..., I] in gate_up's dtype, contiguous."""
    return reference(gate_up).contiguous()


@silu_and_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def takes(gate_up: torch.Tensor) -> bool:
    """Triton installed, float rows of an even width."""
    return (
        triton_installed() and gate_up.dtype in DTYPES and gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0
    )


@silu_and_mul.register_kernel("cuda")
def _cuda(gate_up: torch.Tensor) -> torch.Tensor:
    if takes(gate_up):
        return silu_and_mul_triton(gate_up)
    return reference(gate_up).contiguous()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_mul(x_ptr, out_ptr, x_stride, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * x_stride + width + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        y = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    return _silu_mul


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``deepinfer::silu_and_mul``: one launch."""
    import triton

    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], width)
    if rows.shape[0] and width:
        _kernel()[(rows.shape[0], triton.cdiv(width, BLOCK))](
            rows, out, rows.stride(0), width, BLOCK=BLOCK, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], width)
