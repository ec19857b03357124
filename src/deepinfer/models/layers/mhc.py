"""Manifold-constrained hyper-connections (mHC), model_spec.md §2.2.

The residual is ``hc_mult`` parallel streams ``[..., n, d]``. Each site computes, from the
streams themselves, a collapse mix ``pre`` (streams -> block input), an expand mix ``post``
(block output -> streams) and a doubly-stochastic stream mixer ``comb`` (Sinkhorn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.sinkhorn import sinkhorn
from deepinfer.models.layers.norms import unweighted_rms_norm


def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(pre [..., n], post [..., n], comb [..., n, n])`` in fp32 for streams [..., n, d]."""
    n = streams.shape[-2]
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    m = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_c pre_c * X_c`` in fp32, cast to the stream dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hc_expand(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``out[c'] = post_c' * y + sum_c comb[c, c'] * R_c`` (sum over comb's first index)."""
    dtype = residual.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + mixed


def hc_head_collapse(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """V4's final collapse (``hc_head``): a sigmoid-only ``pre`` mix, no Sinkhorn."""
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return hc_collapse(streams, pre)
