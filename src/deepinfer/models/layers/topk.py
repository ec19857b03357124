"""The spec's tie rule for every top-k that selects entries or blocks (model_spec.md §2.5
item 7): among equal scores the older entry (lower column) wins. ``Tensor.topk`` leaves
ties in an unspecified order that depends on the row width, and so on what shares a step;
a stable descending sort does not."""

from __future__ import annotations

import torch


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest per row of the last dim; equal scores keep their column order."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(k, scores.shape[-1])
    return values[..., :k], indices[..., :k]
