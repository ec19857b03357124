"""RMS norms. Statistics are computed in fp32 and the weight is kept in fp32, as
DeepSeek's reference code keeps every norm weight in fp32.

An eager step on a non-CPU device runs each norm as ``deepinfer::rms_norm`` (one Triton launch
on CUDA instead of five or six); CPU steps, compiled steps (Inductor fuses the plain form),
autograd and ``batch_invariant`` keep the plain form, the op's own reference. A residual add
followed by a norm (``residual_rms_norm``) is one launch the same way
(``deepinfer::add_rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.rms_norm_triton import add_rms_norm, reference, rms_norm
from deepinfer.models.layers.fused_ops import runs_fused


class RMSNorm(nn.Module):
    """``w * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input dtype once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_fused(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        return reference(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim without a learned weight (per-head q norm, mHC input)."""
    if runs_fused(x):
        return rms_norm(x, None, eps)
    return reference(x, None, eps)


def residual_rms_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` and ``norm`` of it: one launch where ``norm`` alone is one."""
    if runs_fused(x, residual, norm.weight) and residual.dtype == x.dtype and residual.shape == x.shape:
        return add_rms_norm(x, residual, norm.weight, norm.eps)
    x = x + residual
    return x, norm(x)
