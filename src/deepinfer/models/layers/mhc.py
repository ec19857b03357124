"""Manifold-constrained hyper-connections (mHC).

The residual is ``hc_mult`` parallel streams ``[..., n, d]``. Each site computes, from the
streams themselves, a collapse mix ``pre`` (streams -> block input), an expand mix ``post``
(block output -> streams) and a doubly-stochastic stream mixer ``comb`` (Sinkhorn).

An eager step on a non-CPU device runs each site as ``deepinfer::hc_pre`` (mixes and collapse)
and ``deepinfer::hc_post`` (expand), two launches on CUDA instead of some twenty; CPU steps,
compiled steps, autograd and ``batch_invariant`` keep the plain form, the ops' own default
(``kernels/mhc_triton.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import mhc_triton
from deepinfer.models.layers.fused_ops import runs_fused
from deepinfer.models.layers.norms import RMSNorm, unweighted_rms_norm

# The mixing functions of the mHC sites and of the final collapse (``hc_{site}_fn``): weights
# the step multiplies with through ``F.linear``, packed for compiled CPU steps.
MIXING_FUNCTIONS = ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn")


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
    return mhc_triton.mixes(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_c pre_c * X_c`` in fp32, cast to the stream dtype."""
    return mhc_triton.collapse(streams, pre)


def hc_expand(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``out[c'] = post_c' * y + sum_c comb[c, c'] * R_c`` (sum over comb's first index)."""
    if runs_fused(residual, y, post, comb):
        return mhc_triton.hc_post(y, residual, post, comb)
    return mhc_triton.expand(y, residual, post, comb)


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


class HyperConnectedBlock(nn.Module):
    """The mHC parameters and norms of one block (``hc_{attn,ffn}_{fn,base,scale}``,
    ``attn_norm``, ``ffn_norm``); subclasses add the attention and FFN and decide which site's
    ``pre`` mix collapses which sublayer's input (V4: its own; V4.1: the previous site's)."""

    def __init__(self, hidden: int, hc_mult: int, eps: float, sinkhorn_iters: int, hc_eps: float) -> None:
        super().__init__()
        n = hc_mult
        mix = (2 + n) * n
        self.hc_mult, self.eps = n, eps
        self.sinkhorn_iters, self.hc_eps = sinkhorn_iters, hc_eps
        self.attn_norm = RMSNorm(hidden, eps)
        self.ffn_norm = RMSNorm(hidden, eps)
        for site in ("attn", "ffn"):
            self.register_parameter(
                f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, n * hidden, dtype=torch.float32))
            )
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def pre(
        self, streams: torch.Tensor, site: str, collapse_with: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, pre, post, comb)`` of ``site``: its mixes and the streams [T, n, d] collapsed
        with ``collapse_with`` (V4.1's lagged mix) or, when None, with the site's own ``pre``."""
        fn, base, scale = (getattr(self, f"hc_{site}_{part}") for part in ("fn", "base", "scale"))
        if runs_fused(streams, fn, base, scale, collapse_with):
            return mhc_triton.hc_pre(
                streams, fn, base, scale, collapse_with, self.sinkhorn_iters, self.hc_eps, self.eps
            )
        pre, post, comb = self.mixes(streams, site)
        return hc_collapse(streams, pre if collapse_with is None else collapse_with), pre, post, comb

    def mixes(self, streams: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre, post, comb)`` of ``site`` ("attn" or "ffn") for streams [T, n, d]."""
        return hc_mixes(
            streams,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
            sinkhorn_iters=self.sinkhorn_iters,
            hc_eps=self.hc_eps,
            norm_eps=self.eps,
        )
