"""The lightning indexer's C++ entry choice (kernels/indexer_topk.py): the Python op's
``ctypes`` kernel and the compiled steps' C++ twin against the plain-PyTorch reference.

The kernel sums in another order than the reference, so exact agreement is checked on inputs
whose every sum is exact in fp32 (small integers, weights and scale powers of two): there the
scores are equal bit for bit and the choice, ties included, must be the same. On random floats
the choice must agree wherever the reference's k-th and next score are clearly apart."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels import indexer_topk
from deepinfer.kernels.cpu import step_ops as cpu_step_ops
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import needs_compiler, require

pytestmark = needs_compiler


@pytest.fixture(autouse=True, scope="module")
def _the_kernels_built() -> None:
    """Both builds of the kernel (its ``ctypes`` library and the step op) are tested: a compile
    error fails these tests; only a machine without a compiler skips them."""
    require(indexer_topk.library() is not None, "the indexer top-k kernel")
    require(cpu_step_ops.available(), "the C++ step ops")


def _inputs(seed: int, t: int, h: int, d: int, e: int, n: int, exact: bool, visible: float):
    gen = torch.Generator().manual_seed(seed)
    if exact:  # every product and sum an integer (times a power of two): exact in fp32
        q = torch.randint(-3, 4, (t, h, d), generator=gen).float()
        keys = torch.randint(-3, 4, (n, d), generator=gen).float()
        weights = torch.randint(-2, 3, (t, h), generator=gen).float() * 0.5
    else:
        q, keys, weights = (
            torch.randn(t, h, d, generator=gen),
            torch.randn(n, d, generator=gen),
            torch.rand(t, h, generator=gen),
        )
    idx = torch.randint(0, n, (t, e), generator=gen)
    valid = torch.rand(t, e, generator=gen) < visible
    return q, keys, idx, valid, weights


def _ops() -> list:
    """The ``ctypes`` kernel behind the Python op, and the step op compiling the same source."""
    return [indexer_topk.indexer_topk, torch.ops.deepinfer.indexer_topk_cpu]


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(0, 24),
    h=st.integers(1, 19),  # whole blocks of eight heads and every remainder
    d=st.integers(1, 40),
    e=st.integers(0, 50),  # whole vectors of entries and partial ones
    n=st.integers(1, 64),
    k=st.integers(1, 12),
    visible=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_inputs_choose_the_references_entries_ties_included(t, h, d, e, n, k, visible, seed):
    q, keys, idx, valid, weights = _inputs(seed, t, h, d, e, n, True, visible)
    want = indexer_topk.reference(q, keys, idx, valid, weights, k, 0.25)
    for op in _ops():
        rows, picked = op(q, keys, idx, valid, weights, k, 0.25)
        assert rows.shape == (t, k) and rows.dtype == torch.long and picked.dtype == torch.bool
        assert torch.equal(rows, want[0]) and torch.equal(picked, want[1])


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 16),
    h=st.sampled_from([1, 8, 11]),
    d=st.sampled_from([16, 32, 50]),
    e=st.integers(1, 70),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_inputs_agree_where_the_choice_is_clear(t, h, d, e, k, seed):
    q, keys, idx, valid, weights = _inputs(seed, t, h, d, e, 90, False, 0.8)
    scale = d**-0.5
    gathered = keys.double()[idx]  # [T, E, D]
    scores = torch.einsum("thd,ted->the", q.double(), gathered).relu() * scale
    scores = (scores * weights.double().unsqueeze(-1)).sum(1).masked_fill(~valid, float("-inf"))
    ordered = scores.sort(dim=-1, descending=True).values
    kk = min(k, e)
    for op in _ops():
        rows, picked = op(q, keys, idx, valid, weights, k, scale)
        want = indexer_topk.reference(q, keys, idx, valid, weights, k, scale)
        for r in range(t):
            # the set of chosen entries is decided where the k-th and next scores differ clearly
            if kk < e and torch.isfinite(ordered[r, kk - 1]) and ordered[r, kk - 1] - ordered[r, kk] < 1e-4:
                continue
            assert sorted(rows[r].tolist()) == sorted(want[0][r].tolist())
            assert picked[r].sum() == want[1][r].sum()


def test_a_rows_choice_does_not_depend_on_the_batch():
    q, keys, idx, valid, weights = _inputs(3, 40, 8, 32, 45, 70, False, 0.7)
    for op in _ops():
        rows, picked = op(q, keys, idx, valid, weights, 4, 0.17)
        for r in (0, 17, 39):
            alone = op(q[r : r + 1], keys, idx[r : r + 1], valid[r : r + 1], weights[r : r + 1], 4, 0.17)
            assert torch.equal(alone[0], rows[r : r + 1]) and torch.equal(alone[1], picked[r : r + 1])


def test_a_visible_entry_outside_the_pool_is_an_index_error_an_invisible_one_is_not():
    q, keys, idx, valid, weights = _inputs(5, 6, 4, 16, 20, 30, True, 0.5)
    idx[2, 3], valid[2, 3] = 1000, False  # never read
    for op in _ops():
        op(q, keys, idx, valid, weights, 4, 0.25)
    valid[2, 3] = True
    for op in _ops():
        with pytest.raises(IndexError, match="outside the key pool"):
            op(q, keys, idx, valid, weights, 4, 0.25)


def test_other_dtypes_take_the_reference():
    q, keys, idx, valid, weights = _inputs(9, 12, 3, 8, 10, 20, True, 0.9)
    want = indexer_topk.reference(q, keys, idx, valid, weights, 5, 0.25)
    for op in _ops():
        rows, picked = op(q.double(), keys.double(), idx, valid, weights.double(), 5, 0.25)
        assert torch.equal(rows, want[0]) and torch.equal(picked, want[1])
