"""Interleaved RoPE as an op: ``deepinfer::rope``, the formula a compiled fp32 CPU step calls.

V4 rotates adjacent channel pairs (``models/layers/rope.py``). Written
inline, Inductor's CPU loops read and write the pairs' strided channels one element at a time
(a visible cost in a tiny-V4 prefill step). Behind this op the graph keeps
the rotation in one call, which ``compile_passes.native_cpu_ops`` points at the C++ twin
``deepinfer::rope_cpu`` (``cpu_step_ops``; whole pairs in vector lanes, the formula's bits).
This Python op is the formula itself: what eager steps compute, and what the twin falls back
to for inputs its kernel does not take. Llama's rotate-half formula (``rotate_half_rope``)
lives here too, beside the interleaved one, so that its fused kernel
(``rope_triton.py``) and the model share one definition."""

from __future__ import annotations

import torch


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last ``2 * cos.shape[-1]`` channels of ``x`` in fp32.

    ``cos``/``sin`` are ``[..., S, rope_dim/2]`` and broadcast against ``x``'s leading dims;
    pass ``-sin`` to undo the rotation."""
    rd = cos.shape[-1] * 2
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE: rotate the two halves of each head in fp32 (cos/sin are [T, 1, D/2]),
    cast back to ``x``'s dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@torch.library.custom_op("deepinfer::rope", mutates_args=())
def rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``interleaved_rope`` as one opaque call (contiguous output, as the fake says)."""
    return interleaved_rope(x, cos, sin).contiguous()


@rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)
