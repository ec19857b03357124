"""Verification schedulers (speculative/schedule.py): Algorithm 1's early stop never looks ahead at a
token's own value (the paper's Appendix A counterexample), the verified tokens per request
shrink as concurrency grows under a synthetic steps-per-second table, and the lagged top-K,
threshold and table lookups do what they say."""

from __future__ import annotations

import pytest

from deepinfer.speculative.schedule import (
    SpsTable,
    capacity_from,
    hardware_schedule,
    lagged_topk_schedule,
    threshold_schedule,
)

APPENDIX_A = SpsTable.from_points({1: 1.0, 2: 0.5, 3: 0.45})


def test_early_stop_never_depends_on_a_later_tokens_confidence():
    """R = 1, γ = 2, SPS(1, 2, 3) = 1, 0.5, 0.45: c_2 is computed from the sampled x_1, so
    whether x_1 is admitted must not change with c_2. Without the early stop it does."""
    grid = [i / 20 for i in range(1, 21)]
    for c1 in grid:
        admitted = {hardware_schedule([[c1, c2]], APPENDIX_A)[0] >= 1 for c2 in grid}
        assert len(admitted) == 1, c1
    flips = [
        c1
        for c1 in grid
        if len({hardware_schedule([[c1, c2]], APPENDIX_A, early_stop=False)[0] >= 1 for c2 in grid}) > 1
    ]
    assert flips, "the global search should anticipate (the counterexample)"


def test_verified_tokens_per_request_shrink_with_concurrency():
    sps = SpsTable.from_points({b: 100.0 / (1 + b / 32) for b in range(1, 1025)})
    conf = [0.9, 0.85, 0.8, 0.75, 0.7]
    per_request = []
    for r in (1, 4, 16, 64, 192, 512):
        lengths = hardware_schedule([conf] * r, sps)
        per_request.append(sum(lengths) / r)
    assert per_request[0] == 5
    assert all(a >= b for a, b in zip(per_request, per_request[1:], strict=False))
    assert per_request[2] < 5 and per_request[-1] == 0  # measured: 5, 5, 3, 2, 1, 0


def test_prefixes_stay_prefixes_and_confident_requests_get_more():
    sps = SpsTable.from_points({1: 10.0, 4: 9.5, 8: 8.0, 16: 5.0})
    lengths = hardware_schedule([[0.95, 0.9, 0.9], [0.3, 0.9, 0.9], [0.99, 0.99, 0.2]], sps)
    assert lengths[0] >= lengths[1] and lengths[2] <= 3
    assert lagged_topk_schedule([[0.9, 0.8], [0.5, 0.4], [0.95, 0.1]], 3) == [2, 0, 1]
    assert lagged_topk_schedule([[0.9, 0.8]], 0) == [0]
    assert capacity_from([[0.9, 0.85, 0.8]] * 2, SpsTable.from_points({1: 1.0})) == 6  # flat SPS: all


def test_threshold_and_table_lookup():
    assert threshold_schedule([[0.9, 0.9, 0.9], [0.5, 0.9]], 0.75) == [2, 0]
    table = SpsTable.from_points({4: 3.0, 16: 2.0})
    assert (table(1), table(4), table(15), table(16), table(1000)) == (3.0, 3.0, 3.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="increasing"):
        SpsTable((4, 2), (1.0, 2.0))
