"""Verification schedulers (speculative/schedule.py): Algorithm 1's early stop never looks ahead at a
token's own value (the paper's Appendix A counterexample), the verified tokens per request
shrink as concurrency grows under a synthetic steps-per-second table, and the lagged top-K,
threshold and table lookups do what they say, and the step-cost fit finds the line its
steps lie on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.speculative.schedule import (
    SpsTable,
    StepCostFit,
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
    assert (table(1), table(4), table(16), table(1000)) == (3.0, 3.0, 2.0, 2.0)
    # between profiled sizes the step time is linear: 1/3 s at 4 rows, 1/2 s at 16
    assert table(10) == pytest.approx(1 / (1 / 3 + (1 / 2 - 1 / 3) * 6 / 12))
    assert table(4) > table(5) > table(15) > table(16)
    with pytest.raises(ValueError, match="increasing"):
        SpsTable((4, 2), (1.0, 2.0))


@settings(max_examples=50, deadline=None)
@given(
    fixed=st.floats(1e-3, 1.0),
    row=st.floats(0.0, 0.1),
    rows=st.lists(st.integers(1, 64), min_size=12, max_size=60).filter(lambda r: len(set(r)) > 1),
)
def test_step_cost_fit_recovers_a_line(fixed, row, rows):
    """Exact step times on a line: the weighted least-squares fit returns it (any decay)."""
    fit = StepCostFit(min_spread=0.0)
    for r in rows:
        fit.observe(r, fixed + row * r)
    line = fit.line()
    assert line is not None
    assert line.fixed_s == pytest.approx(fixed, rel=1e-6, abs=1e-9)
    assert line.row_s == pytest.approx(row, rel=1e-6, abs=1e-9)
    assert line(10) == pytest.approx(1 / (fixed + 10 * row))


def test_step_cost_fit_waits_for_evidence_and_follows_changes():
    fit = StepCostFit()
    for _ in range(50):
        fit.observe(4, 0.03)  # one size only: the row cost is unknown
    assert fit.line() is None
    fit = StepCostFit()
    for r in (3, 8, 3):
        fit.observe(r, 0.02 + 0.002 * r)
    assert fit.line() is None  # too few steps
    for i in range(40):
        fit.observe(3 + 5 * (i % 2), 0.02 + 0.002 * (3 + 5 * (i % 2)))
    assert fit.line().row_s == pytest.approx(0.002)
    for i in range(200):  # the machine slows down: rows now cost twice as much
        fit.observe(3 + 5 * (i % 2), 0.02 + 0.004 * (3 + 5 * (i % 2)))
    assert fit.line().row_s == pytest.approx(0.004, rel=1e-3)
    for _ in range(30):  # then only one size: the slope stays what the older steps showed
        fit.observe(3, 0.032)
    assert fit.line().row_s == pytest.approx(0.004, rel=0.05)
