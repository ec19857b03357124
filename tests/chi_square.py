"""The two-sample chi-square the sampling tests share."""

from __future__ import annotations

import torch


def two_sample_chi_square(a: list[int], b: list[int], vocab: int, bins: int = 6) -> float:
    """Statistic over the ``bins`` most frequent tokens of both samples plus one bin for the
    rest (so df <= bins; 24.32 is its p = 0.001 critical value at df 6)."""
    ca = torch.bincount(torch.tensor(a), minlength=vocab).float()
    cb = torch.bincount(torch.tensor(b), minlength=vocab).float()
    top = (ca + cb).argsort(descending=True)[:bins]
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[top] = False
    ca = torch.cat([ca[top], ca[rest].sum(0, keepdim=True)])
    cb = torch.cat([cb[top], cb[rest].sum(0, keepdim=True)])
    total = ca + cb
    keep = total > 0
    expected = total[keep] / 2
    return float((((ca[keep] - expected) ** 2 + (cb[keep] - expected) ** 2) / expected).sum())
