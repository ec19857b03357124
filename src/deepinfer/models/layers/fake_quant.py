"""QAT fake-quantisation steps baked into the V4 forward.

The released models were trained seeing these activations rounded, so a faithful forward
rounds them too: the window K=V vector to fp8 e4m3 (32-channel blocks, power-of-two scales),
the compressed latent to fp4 e2m1 (16-channel blocks, e4m3 scales), and the indexer's
queries and keys to fp4 e2m1 (32-channel blocks, power-of-two scales). Each function returns
the dequantised values in the input dtype. As in transformers' V4.1 code, a tensor whose last
dim is not a multiple of the block is left alone.

transformers 5.24's V4 model applies none of these, so they are off by default
(``load_model(..., fake_quant=True)`` turns them on). An eager step off the CPU runs each as
one op (``deepinfer::fake_quant``, ``kernels/fake_quant_triton.py``: one launch on CUDA where
the formula is some ten); CPU, compiled and autograd steps keep the formula below.
"""

from __future__ import annotations

import torch

from deepinfer.cache.kv_formats import FP4_MAX, FP8_MAX, block_pow2_scale, round_e2m1
from deepinfer.kernels import fake_quant_triton
from deepinfer.models.layers.fused_ops import runs_fused


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _fused(x: torch.Tensor, block: int) -> bool:
    """Whether the step runs the op (``runs_fused``) on whole blocks."""
    return x.shape[-1] % block == 0 and runs_fused(x)


def _pow2_scale(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-block power-of-two (ue8m0) scale; amax clamped at 1e-4 as the reference does."""
    return block_pow2_scale(blocks, qmax)


def fake_quant_fp8_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 e4m3 with one power-of-two scale per block (the window K=V vector)."""
    if _fused(x, block):
        return fake_quant_triton.fake_quant(x, "fp8_pow2", block)
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, FP8_MAX)
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp4 e2m1 with one power-of-two scale per block (indexer queries and keys)."""
    if _fused(x, block):
        return fake_quant_triton.fake_quant(x, "fp4_pow2", block)
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, FP4_MAX)
    return (round_e2m1(g / scale) * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """fp4 e2m1 with one e4m3 scale per block: scale = clamp(amax, 6*2^-9) / 6 in e4m3."""
    if _fused(x, block):
        return fake_quant_triton.fake_quant(x, "fp4_e4m3", block)
    g = _blocks(x, block)
    if g is None:
        return x
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2**-9)
    scale = (amax / FP4_MAX).to(torch.float8_e4m3fn).float()
    return (round_e2m1(g / scale) * scale).reshape(x.shape).to(x.dtype)
