"""QAT fake-quantisation steps baked into the V4 forward (model_spec.md §2.10).

The released models were trained seeing these activations rounded, so a faithful forward
rounds them too: the window K=V vector to fp8 e4m3 (32-channel blocks, power-of-two scales),
the compressed latent to fp4 e2m1 (16-channel blocks, e4m3 scales), and the indexer's
queries and keys to fp4 e2m1 (32-channel blocks, power-of-two scales). Each function returns
the dequantised values in the input dtype. As in transformers' V4.1 code, a tensor whose last
dim is not a multiple of the block is left alone.

transformers 5.24's V4 model applies none of these, so they are off by default
(``load_model(..., fake_quant=True)`` turns them on).
"""

from __future__ import annotations

import torch

from deepinfer.weights.quant import pow2_scale

FP8_MAX = 448.0
FP4_MAX = 6.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even code as
    hardware casts do. The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so each
    range is ``round`` (half to even) at its own step; an even code is an even multiple of the
    step there. Pure arithmetic: no constant table is copied to the device inside a step."""
    mag = x.abs().clamp(max=FP4_MAX)
    fine = torch.round(mag * 2) / 2
    mid = torch.round(mag)
    coarse = torch.round(mag / 2) * 2
    value = torch.where(mag < 2, fine, torch.where(mag < 4, mid, coarse))
    return torch.copysign(value, x)


def _pow2_scale(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-block power-of-two (ue8m0) scale; amax clamped at 1e-4 as the reference does."""
    return pow2_scale(blocks.abs().amax(dim=-1, keepdim=True), qmax, floor=1e-4)


def fake_quant_fp8_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 e4m3 with one power-of-two scale per block (the window K=V vector)."""
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, FP8_MAX)
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp4 e2m1 with one power-of-two scale per block (indexer queries and keys)."""
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, FP4_MAX)
    return (_round_e2m1(g / scale) * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """fp4 e2m1 with one e4m3 scale per block: scale = clamp(amax, 6*2^-9) / 6 in e4m3."""
    g = _blocks(x, block)
    if g is None:
        return x
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2**-9)
    scale = (amax / FP4_MAX).to(torch.float8_e4m3fn).float()
    return (_round_e2m1(g / scale) * scale).reshape(x.shape).to(x.dtype)
