"""Chi-square tests the sampling tests share, each reporting a p-value (never a fixed
threshold: the degrees of freedom follow the bins actually used)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

MIN_EXPECTED = 5.0  # Cochran's rule: every bin is expected to hold at least this many


def p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution with ``df`` degrees of freedom."""
    if df <= 0:
        return 1.0
    if stat == float("inf"):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def one_sample_chi_square(samples: Sequence[int], probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, df) of ``samples`` against the exact distribution ``probs`` [V].

    Tokens expected at least ``MIN_EXPECTED`` times get a bin each; the rest share one bin
    (merged into the smallest bin when it is expected fewer times). A sample of a token with
    probability 0 gives an infinite statistic."""
    n = len(samples)
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(torch.tensor(list(samples), dtype=torch.long), minlength=probs.numel()).double()
    if bool(((probs == 0) & (counts > 0)).any()):
        return float("inf"), 1
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = [*counts[big].tolist(), float(counts[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] < MIN_EXPECTED and len(exp) > 1:  # fold the small rest into the smallest bin
        i = min(range(len(exp) - 1), key=exp.__getitem__)
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return stat, len(exp) - 1


def conditional_p_value(
    sequences: Sequence[Sequence[int]],
    positions: Sequence[int],
    exact: Callable[[tuple[int, ...]], torch.Tensor],
    min_group: int = 40,
) -> tuple[float, int]:
    """One combined test of sampled sequences at ``positions``: the token at position p,
    given the tokens before it, must follow ``exact(prefix)``. Samples are grouped by their
    prefix; each group of at least ``min_group`` samples adds its statistic and df.
    Returns (p-value, number of samples tested)."""
    stat, df, used = 0.0, 0, 0
    for pos in positions:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for seq in sequences:
            if len(seq) > pos:
                groups[tuple(seq[:pos])].append(seq[pos])
        for prefix, tokens in groups.items():
            if len(tokens) >= min_group:
                s, d = one_sample_chi_square(tokens, exact(prefix))
                stat, df, used = stat + s, df + d, used + len(tokens)
    return p_value(stat, df), used


def exact_next_token(
    path, prompt: list[int], temperature: float
) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """The target's exact sampling distribution (no filters) after ``prompt + prefix``,
    from the plain model forward over the whole sequence."""
    from deepinfer.models.loading import load_model

    model = load_model(path)

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        return torch.softmax(logits.double() / temperature, dim=-1)

    return probs
