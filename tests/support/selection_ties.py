"""How close the model's discrete choices came to going the other way.

A padded batch may change a row's logits in the last bits (matmul blocking depends on the
batch), which the padding tests tolerate. A top-k choice turns such bits into a different
selection only when the k-th and (k+1)-th scores are that close: a near-tie, where either
choice is right. ``selection_margins`` records, for every top-k the model makes (indexer entries,
V4.1 candidate blocks, routed experts), the smallest gap between the last chosen and the first
unchosen finite score, so a test can tell a near-tie from a real difference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from deepinfer.kernels import indexer_topk as indexer_topk_module
from torch.overrides import TorchFunctionMode

import deepinfer.models.layers.indexer as indexer_module
import deepinfer.models.layers.shared_indexer as shared_indexer_module


def boundary_gap(scores: torch.Tensor, k: int) -> float:
    """Smallest relative difference, over rows, between a chosen and an unchosen score (inf when
    no row has a finite one). Scores exactly equal to the k-th are left out: the tie rule (the
    older entry) settles them alike in any batch, and they come from equal computations (relu's
    zeros), not from rounding; a score just above or below such a tie still counts."""
    if scores.numel() == 0 or scores.shape[-1] <= k or k < 1:
        return float("inf")
    top = scores.detach().float().reshape(-1, scores.shape[-1]).sort(dim=-1, descending=True).values
    inf = torch.tensor(float("inf"))
    t, u = top[:, k - 1], top[:, k]
    above = torch.where(top[:, :k] > t[:, None], top[:, :k], inf).amin(dim=-1)
    below = torch.where(top[:, k:] < t[:, None], top[:, k:], -inf).amax(dim=-1)
    gap = torch.where(u == t, torch.minimum(above - t, t - below), t - u)
    gap = torch.where(torch.isfinite(t), gap / t.abs().clamp(min=1.0), inf).nan_to_num(
        nan=float("inf"), posinf=float("inf")
    )
    return gap.min().item()


class _TopkGaps(TorchFunctionMode):
    """Records the gap of every ``torch.topk`` (the routers' expert choice)."""

    def __init__(self, gaps: list[float]) -> None:
        super().__init__()
        self.gaps = gaps

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if kwargs.get("largest", True):
                self.gaps.append(boundary_gap(args[0].movedim(dim, -1), k))
        return func(*args, **kwargs)


@contextlib.contextmanager
def selection_margins() -> Iterator[list[float]]:
    """Within the block, every top-k the model takes appends its ``boundary_gap`` to the list."""
    gaps: list[float] = []
    stable_topk = shared_indexer_module.stable_topk
    kernel = indexer_topk_module.indexer_topk

    def recorded_stable_topk(scores, k):
        gaps.append(boundary_gap(scores, k))
        return stable_topk(scores, k)

    def recorded_kernel(q, keys, entry_idx, entry_valid, weights, topk, scale):
        gaps.append(
            boundary_gap(indexer_topk_module.scores(q, keys, entry_idx, entry_valid, weights, scale), topk)
        )
        return kernel(q, keys, entry_idx, entry_valid, weights, topk, scale)

    with pytest.MonkeyPatch.context() as mp, _TopkGaps(gaps):
        mp.setattr(shared_indexer_module, "stable_topk", recorded_stable_topk)
        mp.setattr(indexer_module, "stable_topk", recorded_stable_topk)
        mp.setattr(indexer_topk_module, "indexer_topk", recorded_kernel)
        yield gaps
