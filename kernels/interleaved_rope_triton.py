"""V4's interleaved RoPE as one launch on CUDA: ``deepinfer::interleaved_rope``, with a Triton
kernel.

In eager PyTorch one rotation (``kernels/rope.py``'s ``interleaved_rope``) is some ten
launches: the cast to fp32, four products, a difference and a sum, the stack, the cast back
and the cat with the unrotated channels; a V4 decode layer rotates its queries, its K=V
vector, its attention output (backwards) and each closed group's entry. Here one program per
row of ``x`` (a token's head) copies the unrotated channels and rotates the pairs as the
formula does: in fp32, a product, a product, then the difference or sum, with no fused
multiply-add (``enable_fp_fusion=False``), rounded once to ``x``'s dtype. ``inverse`` rotates
backwards (``-sin``), which saves the negation's launch; a negated sine gives the same bits.

``models/layers/rope.py`` calls this op on eager non-CPU steps; CPU steps, compiled steps and
autograd keep the plain formula, which is also the op's default implementation. The kernel is
defined at the first CUDA call, so CPU-only machines never import Triton; it also runs under
``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepinfer.kernels.rope import interleaved_rope
from deepinfer.kernels.triton_support import triton_installed

# activation dtypes the kernel takes (the angles are fp32)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The plain formula, backwards with ``inverse``; contiguous."""
    return interleaved_rope(x, cos, -sin if inverse else sin).contiguous()


@torch.library.custom_op("deepinfer::interleaved_rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``x`` [..., D] with its last ``2 * cos.shape[-1]`` channels rotated in adjacent pairs;
    ``cos``/``sin`` [..., rope_dim / 2] broadcast against ``x``'s leading dims."""
    return reference(x, cos, sin, inverse)


@rope.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Triton installed; x [T, D] or [T, H, D] of a float dtype with unit channel stride; fp32
    angles that broadcast against x's leading dims."""
    if not (triton_installed() and x.dtype in DTYPES and x.dim() in (2, 3) and x.stride(-1) == 1):
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape:
        return False
    half = cos.shape[-1]
    if not 0 < 2 * half <= x.shape[-1] or cos.dim() > x.dim():
        return False
    try:
        torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1])
    except RuntimeError:
        return False
    return torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1]) == x.shape[:-1]


@rope.register_kernel("cuda")
def _cuda(x, cos, sin, inverse) -> torch.Tensor:
    if takes(x, cos, sin):
        return rope_triton(x, cos, sin, inverse)
    return reference(x, cos, sin, inverse)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _interleaved_rope(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        x_stride_a,
        x_stride_b,
        c_stride_a,
        c_stride_b,
        s_stride_a,
        s_stride_b,
        heads,
        nope,
        half,
        SIGN: tl.constexpr,
        BLOCK_NOPE: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        a = tl.program_id(0).to(tl.int64)  # token
        b = tl.program_id(1).to(tl.int64)  # head (0 for a [T, D] input)
        src = x_ptr + a * x_stride_a + b * x_stride_b
        dst = out_ptr + (a * heads + b) * (nope + 2 * half)
        for start in range(0, nope, BLOCK_NOPE):
            k = start + tl.arange(0, BLOCK_NOPE)
            keep = k < nope
            tl.store(dst + k, tl.load(src + k, mask=keep), mask=keep)
        j = tl.arange(0, BLOCK_HALF)
        ok = j < half
        even = tl.load(src + nope + 2 * j, mask=ok, other=0.0)
        odd = tl.load(src + nope + 2 * j + 1, mask=ok, other=0.0)
        c = tl.load(cos_ptr + a * c_stride_a + b * c_stride_b + j, mask=ok, other=0.0)
        s = tl.load(sin_ptr + a * s_stride_a + b * s_stride_b + j, mask=ok, other=0.0)
        s = s * SIGN  # exact: a negated sine
        e, o = even.to(tl.float32), odd.to(tl.float32)
        lo = e * c - o * s
        hi = o * c + e * s
        tl.store(dst + nope + 2 * j, lo.to(even.dtype), mask=ok)
        tl.store(dst + nope + 2 * j + 1, hi.to(even.dtype), mask=ok)

    return _interleaved_rope


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Same contract as ``deepinfer::interleaved_rope`` (``takes`` holds): one launch."""
    import triton

    half = cos.shape[-1]
    out = x.new_empty(x.shape)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, D]
    t, heads, d = x3.shape
    if x3.numel() == 0:
        return out
    c = cos.expand(*x.shape[:-1], half)
    s = sin.expand(*x.shape[:-1], half)
    if c.stride(-1) != 1:
        c = c.contiguous()
    if s.stride(-1) != 1:
        s = s.contiguous()
    c3, s3 = (c, s) if x.dim() == 3 else (c.unsqueeze(1), s.unsqueeze(1))
    nope = d - 2 * half
    _kernel()[(t, heads)](
        x3,
        c3,
        s3,
        out,
        x3.stride(0),
        x3.stride(1),
        c3.stride(0),
        c3.stride(1),
        s3.stride(0),
        s3.stride(1),
        heads,
        nope,
        half,
        SIGN=-1.0 if inverse else 1.0,
        BLOCK_NOPE=min(1024, max(16, triton.next_power_of_2(max(nope, 1)))),
        BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        num_warps=1 if d <= 256 else 4,
        enable_fp_fusion=False,  # the formula's products and sums round apart
    )
    return out
