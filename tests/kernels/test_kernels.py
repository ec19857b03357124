"""Fast kernel paths agree with their reference definitions."""

from __future__ import annotations

import contextlib

import pytest
import torch
from deepinfer.kernels.sinkhorn import BLOCK, THREADED_COUNT, _cpp, _numpy, library, reference, sinkhorn
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels' threaded paths, at any -n


@contextlib.contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 40),
    n=st.integers(1, 8),
    iters=st.integers(0, 25),
    spread=st.floats(0.1, 8.0),
    seed=st.integers(0, 2**16),
)
def test_sinkhorn_paths_match_reference(count, n, iters, spread, seed):
    """The C++ and NumPy paths agree with the PyTorch definition for any matrix size and
    iteration count (the op picks C++ where a compiler exists)."""
    logits = torch.randn(count, n, n, generator=torch.Generator().manual_seed(seed)) * spread
    ref = reference(logits, iters, 1e-6)
    assert torch.allclose(_numpy(logits, iters, 1e-6), ref, atol=2e-6)
    lib = library()
    assert lib is not None  # CI has a compiler: the C++ path must be the one tested
    assert torch.allclose(_cpp(logits, iters, 1e-6, lib), ref, atol=2e-6)
    assert torch.allclose(sinkhorn(logits, iters, 1e-6), ref, atol=2e-6)


def test_sinkhorn_mutation_is_caught():
    """The comparison above can fail: ending on rows instead of columns is detected."""
    logits = torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(3)) * 3
    wrong = reference(logits, 20, 1e-6)
    wrong = wrong / (wrong.sum(dim=-1, keepdim=True) + 1e-6)
    assert not torch.allclose(_cpp(logits, 20, 1e-6, library()), wrong, atol=2e-6)


def test_sinkhorn_rows_do_not_depend_on_the_batch():
    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sinkhorn(logits, 20, 1e-6)[5:6], sinkhorn(logits[5:6], 20, 1e-6))


@settings(max_examples=6, deadline=None)
@given(extra=st.integers(0, 2 * BLOCK + 3), seed=st.integers(0, 2**16))
def test_sinkhorn_threaded_blocks_match_one_thread(extra, seed):
    """From ``THREADED_COUNT`` matrices the blocks split over the threads: every matrix,
    the partial last block's included, keeps the one-thread bits and the definition's values."""
    logits = torch.randn(THREADED_COUNT + extra, 4, 4, generator=torch.Generator().manual_seed(seed)) * 3
    lib = library()
    threaded = _cpp(logits, 20, 1e-6, lib)
    with torch_threads(1):
        alone = _cpp(logits, 20, 1e-6, lib)
    assert torch.equal(threaded, alone)
    assert torch.equal(threaded[-1:], _cpp(logits[-1:], 20, 1e-6, lib))
    assert torch.allclose(threaded, reference(logits, 20, 1e-6), atol=2e-6)


def _naive_routed_experts(x, weights, ids, w1, w2, w3, limit):
    """Token by token, choice by choice: the definition the sorted dispatch must equal."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate = (w1[e] @ x[n]).clamp(max=limit)
            up = (w3[e] @ x[n]).clamp(min=-limit, max=limit)
            out[n] += weights[n, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_routed_experts_op_matches_the_definition():
    from deepinfer.kernels.moe import routed_experts

    gen = torch.Generator().manual_seed(2)
    e, d, inter, n, k = 6, 16, 24, 11, 2
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    ids[0] = torch.tensor([5, 5 - 1])  # some experts get no token, some several
    weights = torch.rand(n, k, generator=gen)
    w1, w3 = torch.randn(e, inter, d, generator=gen), torch.randn(e, inter, d, generator=gen)
    w2 = torch.randn(e, d, inter, generator=gen) / inter**0.5
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.5)
    assert torch.allclose(got, _naive_routed_experts(x, weights, ids, w1, w2, w3, 1.5), atol=1e-5)
    empty = routed_experts(x[:0], weights[:0], ids[:0], w1, w2, w3, 1.5)
    assert empty.shape == (0, d)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 20),
    e=st.integers(1, 9),
    k=st.integers(1, 4),
    d=st.integers(1, 40),
    inter=st.integers(1, 40),
    limit=st.floats(0.5, 20.0),
    seed=st.integers(0, 2**16),
)
def test_routed_experts_paths_match_the_definition(n, e, k, d, inter, limit, seed):
    """Both CPU kernels and the sorted dispatch equal the token-by-token definition, for any
    width (vector tails included), expert count and top-k; each kernel gives a token the same
    bits whatever it is batched with."""
    from deepinfer.kernels.cpu import moe as cpu_moe
    from deepinfer.kernels.moe import routed_experts, routed_experts_reference

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * 2
    ids = torch.randint(0, e, (n, k), generator=gen)
    weights = torch.rand(n, k, generator=gen)
    w1, w3 = torch.randn(e, inter, d, generator=gen), torch.randn(e, inter, d, generator=gen)
    w2 = torch.randn(e, d, inter, generator=gen) / inter**0.5
    want = _naive_routed_experts(x, weights, ids, w1, w2, w3, limit)
    tol = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(routed_experts_reference(x, weights, ids, w1, w2, w3, limit), want, **tol)
    assert torch.allclose(routed_experts(x, weights, ids, w1, w2, w3, limit), want, **tol)
    kernels = [cpu_moe.routed_experts_transposed]  # these experts are small
    if n <= cpu_moe.MAX_ROWS:
        kernels.append(cpu_moe.routed_experts_dot)
    assert cpu_moe.supports(x, w1, w2, w3)  # CI has a compiler: a kernel is what ran above
    for kernel in kernels:
        got = kernel(x, weights, ids, w1, w2, w3, limit)
        assert torch.allclose(got, want, **tol)
        for row in range(n):
            alone = kernel(x[row : row + 1], weights[row : row + 1], ids[row : row + 1], w1, w2, w3, limit)
            assert torch.equal(alone[0], got[row])


def test_routed_experts_at_prefill_sizes_take_the_kernel_that_measured_faster():
    """Tiny experts run the transposed kernel at a whole prefill step's tokens (its threaded
    path), equal to the sorted dispatch to fp32 rounding and row by row independent of the
    batch; experts of 1 MiB go to the dispatch past a few dozen tokens (the crossovers
    ``kernels/cpu/moe.py`` lists beside ``SMALL_EXPERT_BYTES``, from benchmarks/RESULTS.md)."""
    from deepinfer.kernels.cpu import moe as cpu_moe
    from deepinfer.kernels.moe import routed_experts, routed_experts_reference

    gen = torch.Generator().manual_seed(9)
    n, e, k, d, inter = 2048, 8, 2, 64, 64
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=gen)
    w1, w3 = torch.randn(e, inter, d, generator=gen) / 8, torch.randn(e, inter, d, generator=gen) / 8
    w2 = torch.randn(e, d, inter, generator=gen) / 8
    assert cpu_moe.transposed_rows(w1) >= n and cpu_moe.supports(x, w1, w2, w3)
    got = routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    assert torch.allclose(got, routed_experts_reference(x, weights, ids, w1, w2, w3, 10.0), atol=1e-5)
    for row in (0, 777, n - 1):
        alone = cpu_moe.routed_experts_transposed(
            x[row : row + 1], weights[row : row + 1], ids[row : row + 1], w1, w2, w3, 10.0
        )
        assert torch.equal(alone[0], got[row])
    big = torch.empty(e, 512, 512)  # 1 MiB matrices
    assert cpu_moe.transposed_rows(big) == cpu_moe.MAX_ROWS_SMALL_EXPERTS < 64
    assert not cpu_moe.supports(torch.randn(64, 512), big, big.transpose(1, 2).contiguous(), big)


def test_transposed_expert_copies_follow_in_place_writes():
    """The transposed kernel keeps copies of the experts: writing the weights in place (a
    research edit, a reload) must not leave it computing with the old ones."""
    from deepinfer.kernels.cpu import moe as cpu_moe

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 16, generator=gen)
    ids = torch.randint(0, 3, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    w1, w3 = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    w2 = torch.randn(3, 16, 8, generator=gen)
    cpu_moe.routed_experts_transposed(x, weights, ids, w1, w2, w3, 10.0)
    w1.mul_(-2.0)
    got = cpu_moe.routed_experts_transposed(x, weights, ids, w1, w2, w3, 10.0)
    assert torch.allclose(got, _naive_routed_experts(x, weights, ids, w1, w2, w3, 10.0), atol=1e-4)


def test_routed_experts_kernel_mutation_is_caught():
    """The comparison can fail: the definition without the SwiGLU clamps (limit 1e9) differs."""
    from deepinfer.kernels.cpu import moe as cpu_moe

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 16, generator=gen) * 4
    ids = torch.randint(0, 3, (4, 2), generator=gen)
    weights = torch.rand(4, 2, generator=gen)
    w1, w3 = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    w2 = torch.randn(3, 16, 8, generator=gen)
    for kernel in (cpu_moe.routed_experts_dot, cpu_moe.routed_experts_transposed):
        got = kernel(x, weights, ids, w1, w2, w3, 1.0)
        assert torch.allclose(got, _naive_routed_experts(x, weights, ids, w1, w2, w3, 1.0), atol=1e-4)
        assert not torch.allclose(got, _naive_routed_experts(x, weights, ids, w1, w2, w3, 1e9), atol=1e-4)


def test_custom_ops_pass_opcheck():
    """Schema, fake (tracing) implementation and aliasing rules of each registered op."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=gen)
    ids = torch.randint(0, 3, (5, 2), generator=gen)
    args = (x, torch.rand(5, 2, generator=gen), ids)
    experts = (
        torch.randn(3, 4, 8, generator=gen),
        torch.randn(3, 8, 4, generator=gen),
        torch.randn(3, 4, 8, generator=gen),
    )
    torch.library.opcheck(torch.ops.deepinfer.routed_experts.default, (*args, *experts, 10.0))
    torch.library.opcheck(
        torch.ops.deepinfer.sinkhorn.default, (torch.randn(6, 4, 4, generator=gen), 20, 1e-6)
    )


def _sorted_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie rule written out: a stable descending sort, first k columns."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 40),
    k=st.integers(1, 8),
    levels=st.integers(1, 5),
    masked=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_topk_by_rounds_equals_the_stable_sort(rows, cols, k, levels, masked, seed):
    """Few distinct scores (ties everywhere) and -inf (masked entries, whole rows of them)."""
    from deepinfer.models.layers.topk import topk_by_rounds

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, cols), generator=gen).float()
    scores[torch.rand(rows, cols, generator=gen) < masked] = float("-inf")
    got_values, got_indices = topk_by_rounds(scores, k)
    k = min(k, cols)
    want_values, want_indices = _sorted_topk(scores, k)
    assert (got_indices[:, k:] == cols).all() and (got_values[:, k:] == float("-inf")).all()
    got_values, got_indices = got_values[:, :k], got_indices[:, :k]
    assert torch.equal(got_values, want_values) and torch.equal(got_indices, want_indices)


def test_compiled_stable_topk_takes_the_rounds_and_keeps_the_tie_rule():
    """Under torch.compile the traced graph has no sort (the rounds ran) and ties still go
    to the lower column; eagerly the sort runs."""
    from deepinfer.models.layers.topk import stable_topk

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm

    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, float("-inf")], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    compiled = torch.compile(lambda s: stable_topk(s, 4), backend=recording, dynamic=True)
    values, indices = compiled(scores)
    assert indices.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]
    assert torch.equal(values, _sorted_topk(scores, 4)[0])
    names = {getattr(n.target, "__name__", n.target) for g in graphs for n in g.graph.nodes}
    assert "sort" not in names and "amax" in names
    assert torch.equal(stable_topk(scores, 4)[1], indices)


def test_the_transposed_expert_kernel_answers_nan_for_a_negative_expert_id():
    """Its pairs are grouped by expert id; an id below 0 (no router gives one) must not index
    out of bounds: the whole output is NaN instead."""
    from deepinfer.kernels.cpu import moe as cpu_moe

    w = torch.randn(4, 8, 8)
    ids = torch.tensor([[0], [-1], [2]])
    out = cpu_moe.routed_experts_transposed(torch.randn(3, 8), torch.rand(3, 1), ids, w, w, w, 3.0)
    assert out.isnan().all()
