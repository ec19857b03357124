"""RMS norms. Statistics are computed in fp32 and the weight is kept in fp32, as
DeepSeek's reference code keeps every norm weight in fp32."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``w * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input dtype once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim without a learned weight (per-head q norm, mHC input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
