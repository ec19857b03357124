"""Our tie rule for every top-k that selects entries or blocks: among equal scores the older
entry (lower column) wins. ``Tensor.topk`` leaves ties in an unspecified order that depends on
the row width, and so on what shares a step; a stable descending sort does not.

Under ``torch.compile`` a small ``k`` (a tiny model's indexer, a few blocks) takes ``k``
selection rounds instead of the sort: each round takes the row's largest untaken score at its
lowest column, which is the sort's next element, so the result is the same. The rounds are
reductions Inductor fuses, several times faster than the compiled stable sort; eagerly the
sort is the faster, so eager steps keep it. Scores are assumed not NaN (a sort would put NaN
first)."""

from __future__ import annotations

import torch

# Largest k selected by rounds (each round reads the row once; the sort reads it ~log n times).
MAX_ROUNDS = 8


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest per row of the last dim; equal scores keep their column order."""
    if k <= MAX_ROUNDS and torch.compiler.is_compiling():
        # k rounds whatever the row width, so a symbolic width is never specialised; rounds
        # past the width pick nothing and are cut off with the sort path's min(k, width)
        values, indices = topk_by_rounds(scores, k)
    else:
        values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(k, scores.shape[-1])
    return values[..., :k], indices[..., :k]


def topk_by_rounds(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` rounds of max-then-lowest-column: ``stable_topk``'s first ``min(k, width)`` columns,
    then (rounds past the row width) -inf at index ``width``."""
    n = scores.shape[-1]
    columns = torch.arange(n, device=scores.device)
    taken = torch.zeros_like(scores, dtype=torch.bool)
    values, indices = [], []
    for _ in range(k):
        free = scores.masked_fill(taken, float("-inf"))
        best = free.amax(dim=-1, keepdim=True)
        first = torch.where((free == best) & ~taken, columns, n).amin(dim=-1, keepdim=True)
        taken = taken | (columns == first)
        values.append(best)
        indices.append(first)
    if not values:
        empty = scores[..., :0]
        return empty, empty.long()
    return torch.cat(values, dim=-1), torch.cat(indices, dim=-1)
