"""How many drafted tokens each request verifies in a step (DSpark paper §3.2.2 Algorithm 1
and §5.2).

A drafter with a confidence head gives, per request r, confidences ``c_{r,1..γ}`` that each
drafted token survives verification; ``a_{r,j} = prod_{i<=j} c_{r,i}`` is the expected survival of
the prefix of length j. Verifying more tokens raises the expected tokens per step ``tau`` but
lowers the steps per second ``SPS(B)`` at the larger batch ``B``; the schedulers pick lengths
``l_r`` that maximise ``tau * SPS(B)``:

- ``hardware_schedule``: Algorithm 1 — one global descending sort of ``a_{r,j}``, walk it,
  stop at the first candidate that does not improve throughput (the early stop keeps each
  admission independent of later tokens' values: the losslessness condition);
- ``lagged_topk_schedule`` + ``capacity_from``: the production variant — the total capacity
  comes from confidences two steps old (known before the step launches), the current
  confidences only rank candidates, no early stop;
- ``threshold_schedule``: the longest prefix whose survival stays >= a threshold;
- static: every request verifies all its drafts (``SpeculativeConfig.schedule="static"``).

A request always verifies its anchor slot (the token it samples anyway), so ``B`` starts at R.

``SPS`` comes from ``SpsTable``, profiled at engine start on steps of null tokens, and, once the
engine has timed enough of its own decode and verification steps, from ``StepCostFit``: a
least-squares line of step time against rows over recent steps. The profile sees neither the
context the rows attend to nor the machine's current speed; on SmolLM2 with contexts of a few
hundred tokens it priced a row at a fraction of what the engine's steps paid, and the schedule
then verified drafts that cost more than they saved (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpsTable:
    """Target steps per second at a forward batch of B tokens, profiled at engine start.
    Between profiled sizes the step *time* is interpolated linearly (a step's time grows
    with its rows; a step function would make every row up to the next profiled size look
    free); below the smallest size and above the largest it is that size's value."""

    sizes: tuple[int, ...]
    steps_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.steps_per_s):
            raise ValueError("SpsTable needs one steps/s value per profiled size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError("SpsTable sizes must be increasing positive integers")

    @classmethod
    def from_points(cls, points: dict[int, float]) -> SpsTable:
        sizes = tuple(sorted(points))
        return cls(sizes, tuple(float(points[s]) for s in sizes))

    def __call__(self, batch: int) -> float:
        i = bisect.bisect_right(self.sizes, batch) - 1
        if i < 0:
            return self.steps_per_s[0]
        if i == len(self.sizes) - 1 or batch == self.sizes[i]:
            return self.steps_per_s[i]
        lo, hi = self.sizes[i], self.sizes[i + 1]
        t_lo, t_hi = 1.0 / self.steps_per_s[i], 1.0 / self.steps_per_s[i + 1]
        return 1.0 / (t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo))


@dataclass(frozen=True)
class LinearSps:
    """Steps per second of a step costing ``fixed_s + row_s * B`` seconds at B rows."""

    fixed_s: float
    row_s: float

    def __call__(self, batch: int) -> float:
        return 1.0 / (self.fixed_s + self.row_s * batch)


@dataclass
class StepCostFit:
    """Step time against rows, fitted by least squares over the engine's recent decode and
    verification steps, each weighed ``decay`` times less per step since. The old steps
    keep the slope known while the schedule runs steps of one size (which carry no
    information about it)."""

    decay: float = 0.97
    min_weight: float = 8.0  # about this many recent steps before the fit is trusted
    min_spread: float = 0.25  # and a variance of their row counts (rows squared)
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def line(self) -> LinearSps | None:
        """The fitted cost, or None while too few steps, too little spread in their rows, or
        a line with no positive fixed part (a noisy fit) leave it unknown."""
        if self._w < self.min_weight:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_spread:
            return None
        row_s = max(0.0, (self._xy / self._w - mx * my) / var)
        fixed_s = my - row_s * mx
        return LinearSps(fixed_s, row_s) if fixed_s > 0 else None


def survival(confidences: Sequence[float]) -> list[float]:
    out, acc = [], 1.0
    for c in confidences:
        acc *= c
        out.append(acc)
    return out


def _candidates(confidences: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """(a_{r,j}, r, j) with a > 0, sorted by a descending; ties keep (r, j) order, so a
    request's j always follows its j - 1 (a never increases along j)."""
    pool = [
        (a, r, j + 1) for r, conf in enumerate(confidences) for j, a in enumerate(survival(conf)) if a > 0
    ]
    pool.sort(key=lambda t: (-t[0], t[1], t[2]))
    return pool


def hardware_schedule(
    confidences: Sequence[Sequence[float]], sps: Callable[[int], float], early_stop: bool = True
) -> list[int]:
    """Algorithm 1. ``early_stop=False`` is the global search that is lossless only with
    lagged information (``lagged_topk_schedule``); with current confidences it anticipates."""
    r_count = len(confidences)
    lengths = [0] * r_count
    best_lengths = list(lengths)
    batch, tau = r_count, float(r_count)
    best = tau * sps(batch)
    for a, r, j in _candidates(confidences):
        lengths[r] = j
        batch += 1
        tau += a
        theta = tau * sps(batch)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


def capacity_from(confidences: Sequence[Sequence[float]], sps: Callable[[int], float]) -> int:
    """Total verify slots for the next step, from (two-step-old) confidences: Algorithm 1
    without the early stop, summed over requests."""
    return sum(hardware_schedule(confidences, sps, early_stop=False))


def lagged_topk_schedule(confidences: Sequence[Sequence[float]], capacity: int) -> list[int]:
    """The ``capacity`` candidates with the highest current survival (prefix-closed)."""
    lengths = [0] * len(confidences)
    for _, r, j in _candidates(confidences)[: max(capacity, 0)]:
        lengths[r] = j
    return lengths


def threshold_schedule(confidences: Sequence[Sequence[float]], threshold: float) -> list[int]:
    return [sum(1 for a in survival(conf) if a >= threshold) for conf in confidences]
