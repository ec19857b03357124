"""``deepinfer::routed_experts_cpu`` / ``sinkhorn_cpu`` / ``indexer_topk_cpu`` / ``rope_cpu``
(kernels/cpu/step_ops.py; ``sink_attention_rows_cpu`` in test_sink_attention_rows.py) and the
pass that puts them into compiled CPU steps.

The C++ ops must return exactly what the Python ops they stand in for return, on every input:
the same kernels where those run (same bits), the Python op itself where they do not. The
tests check that on generated shapes across both expert kernels and the fallbacks, that an
in-place write to the experts never leaves a stale transposed copy in use, that freed experts'
copies go, and that a compiled tiny-V4 step calls the C++ ops and agrees with eager."""

from __future__ import annotations

import gc

import pytest
import torch
from deepinfer.kernels import moe, sinkhorn
from deepinfer.kernels.cpu import moe as cpu_moe
from deepinfer.kernels.cpu import step_ops as cpu_step_ops
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import needs_compiler, require

pytestmark = needs_compiler


@pytest.fixture(autouse=True, scope="module")
def _the_ops_built() -> None:
    """A compile error fails these tests; only a machine without a compiler skips them."""
    require(cpu_step_ops.available(), "the C++ step ops")


def _experts(gen: torch.Generator, e: int, d: int, inter: int) -> tuple[torch.Tensor, ...]:
    w1 = torch.randn(e, inter, d, generator=gen) / d**0.5
    w2 = torch.randn(e, d, inter, generator=gen) / inter**0.5
    w3 = torch.randn(e, inter, d, generator=gen) / d**0.5
    return w1, w2, w3


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 80),
    d=st.sampled_from([8, 24, 64, 100]),
    inter=st.sampled_from([8, 40, 64]),
    e=st.integers(1, 8),
    k=st.integers(1, 3),
    size=st.sampled_from(["tiny", "small", "big"]),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_routed_experts_cpu_returns_the_python_ops_bits(rows, d, inter, e, k, size, dtype, seed):
    """Tiny experts (the transposed kernel at any row count), small ones (the transposed kernel
    up to ``MAX_ROWS_SMALL_EXPERTS`` rows, the Python reference above), large ones (the dot
    kernel up to ``MAX_ROWS`` rows, the reference above), and float64 (the Python op
    throughout): the C++ op's choice of path must be the Python op's at every boundary."""
    gen = torch.Generator().manual_seed(seed)
    if size == "small":  # matrices just over TINY_EXPERT_BYTES
        inter = cpu_moe.TINY_EXPERT_BYTES // (4 * d) + 1
    elif size == "big":  # matrices over SMALL_EXPERT_BYTES: no transposed kernel
        inter = cpu_moe.SMALL_EXPERT_BYTES // (4 * d) + 1
    w1, w2, w3 = (w.to(dtype) for w in _experts(gen, e, d, inter))
    x = torch.randn(rows, d, generator=gen, dtype=dtype)
    ids = torch.randint(0, e, (rows, k), generator=gen)
    weights = torch.rand(rows, k, generator=gen)
    got = torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, w1, w2, w3, 3.0)
    want = torch.ops.deepinfer.routed_experts(x, weights, ids, w1, w2, w3, 3.0)
    assert got.dtype == want.dtype and torch.equal(got, want)
    ref = moe.routed_experts_reference(
        x.double(), weights.double(), ids, w1.double(), w2.double(), w3.double(), 3.0
    )
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("size", "rows"),
    [
        ("small", cpu_moe.MAX_ROWS_SMALL_EXPERTS),
        ("small", cpu_moe.MAX_ROWS_SMALL_EXPERTS + 1),
        ("big", cpu_moe.MAX_ROWS),
        ("big", cpu_moe.MAX_ROWS + 1),
    ],
)
def test_routed_experts_cpu_switches_kernels_where_the_python_op_does(size, rows):
    """At each row limit and one past it: the same path as the Python op, so the same bits."""
    gen = torch.Generator().manual_seed(rows)
    d = 64
    limit = cpu_moe.TINY_EXPERT_BYTES if size == "small" else cpu_moe.SMALL_EXPERT_BYTES
    w1, w2, w3 = _experts(gen, 4, d, limit // (4 * d) + 1)
    x, ids, weights = (
        torch.randn(rows, d, generator=gen),
        torch.randint(0, 4, (rows, 2), generator=gen),
        torch.rand(rows, 2),
    )
    got = torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, w1, w2, w3, 3.0)
    assert torch.equal(got, torch.ops.deepinfer.routed_experts(x, weights, ids, w1, w2, w3, 3.0))


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(0, 40), min_size=0, max_size=2),
    n=st.integers(1, 6),
    iters=st.integers(1, 25),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sinkhorn_cpu_returns_the_python_ops_bits(lead, n, iters, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    comb = torch.randn(*lead, n, n, generator=gen, dtype=dtype)
    got = torch.ops.deepinfer.sinkhorn_cpu(comb, iters, 1e-6)
    assert got.dtype == dtype and torch.equal(got, torch.ops.deepinfer.sinkhorn(comb, iters, 1e-6))
    assert torch.allclose(got.double(), sinkhorn.reference(comb.double(), iters, 1e-6), atol=1e-5)
    strided = torch.randn(*lead, n, n + 2, generator=gen, dtype=dtype)[..., :n]  # not contiguous
    assert torch.equal(
        torch.ops.deepinfer.sinkhorn_cpu(strided, iters, 1e-6),
        torch.ops.deepinfer.sinkhorn(strided, iters, 1e-6),
    )


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 300),
    heads=st.sampled_from([None, 1, 3, 8]),  # None: rows [T, D] with one table row each
    half=st.sampled_from([1, 3, 8, 12, 32]),  # pairs: scalar tails, one or several vectors
    keep=st.sampled_from([0, 5, 48]),  # channels before the rotated ones
    per_row=st.booleans(),  # tables per (token, head) row rather than per token
    inverse=st.booleans(),  # -sin: the output's de-rotation
    transposed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rope_cpu_returns_the_python_formulas_bits(
    tokens, heads, half, keep, per_row, inverse, transposed, seed
):
    """The C++ RoPE gives the bits of ``apply_rope``'s formula (which eager steps run) for
    every layout the model passes: per-token tables broadcast over heads, per-row tables, 2-D
    rows, the inverse rotation, odd pair counts, non-contiguous input, threaded sizes."""
    from deepinfer.models.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(seed)
    d = keep + 2 * half
    shape = (tokens, d) if heads is None else (tokens, heads, d)
    x = torch.randn(*shape, generator=gen) * 3
    if transposed and heads is not None:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    table = (tokens, half) if heads is None else (tokens, heads if per_row else 1, half)
    angles = torch.rand(*table, generator=gen) * 50
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    out = torch.ops.deepinfer.rope_cpu(x, cos, sin)
    ref = apply_rope(x, cos, sin)
    assert out.is_contiguous() and out.shape == ref.shape
    assert torch.equal(out, ref)


def test_rope_cpu_falls_back_to_the_formula_where_its_kernel_does_not_apply():
    """Other dtypes, autograd and tables that broadcast over tokens take ATen's formula."""
    from deepinfer.models.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 40, generator=gen)
    cos, sin = torch.rand(6, 1, 8, generator=gen), torch.rand(6, 1, 8, generator=gen)
    shared = (cos[:1], sin[:1])  # one table row for every token
    for args in [(x.double(), cos.double(), sin.double()), (x.bfloat16(), cos, sin), (x, *shared)]:
        assert torch.equal(torch.ops.deepinfer.rope_cpu(*args), apply_rope(*args))
    grad = x.clone().requires_grad_()
    torch.testing.assert_close(torch.ops.deepinfer.rope_cpu(grad, cos, sin), apply_rope(x, cos, sin))


def test_experts_written_in_place_are_never_read_from_a_stale_copy():
    gen = torch.Generator().manual_seed(1)
    w1, w2, w3 = _experts(gen, 4, 16, 16)
    x, ids, weights = (
        torch.randn(6, 16, generator=gen),
        torch.randint(0, 4, (6, 2), generator=gen),
        torch.rand(6, 2),
    )
    torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, w1, w2, w3, 10.0)  # copies made
    for w in (w1, w2, w3):  # each of the three is checked
        with torch.no_grad():
            w.mul_(1.5)
        got = torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, w1, w2, w3, 10.0)
        assert torch.equal(got, torch.ops.deepinfer.routed_experts(x, weights, ids, w1, w2, w3, 10.0))
    fresh = tuple(w.clone() for w in (w1, w2, w3))  # same values, new tensors
    assert torch.equal(
        torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, *fresh, 10.0),
        torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, w1, w2, w3, 10.0),
    )


def test_freed_experts_copies_are_dropped():
    gen = torch.Generator().manual_seed(2)
    x, ids, weights = (
        torch.randn(3, 8, generator=gen),
        torch.randint(0, 2, (3, 1), generator=gen),
        torch.rand(3, 1),
    )
    held = cpu_step_ops.transposed_count()
    for _ in range(5):
        w = _experts(gen, 2, 8, 8)
        torch.ops.deepinfer.routed_experts_cpu(x, weights, ids, *w, 10.0)
        del w
        gc.collect()
    assert cpu_step_ops.transposed_count() <= held


def test_the_pass_leaves_graphs_alone_where_the_ops_did_not_build(monkeypatch):
    from deepinfer.compile_passes import use_native_cpu_ops

    graph = torch.fx.Graph()
    comb = graph.placeholder("comb")
    graph.output(graph.call_function(torch.ops.deepinfer.sinkhorn.default, (comb, 20, 1e-6)))
    monkeypatch.setattr(cpu_step_ops, "available", lambda: False)
    assert use_native_cpu_ops(graph) == 0


@pytest.fixture(scope="module")
def eager_v4(v4_ckpt):
    """The tiny V4's eager engine, the reference both compiled-step tests compare with."""
    from deepinfer import LLM

    llm = LLM(v4_ckpt, compile=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def compiled_v4(v4_ckpt):
    """One compiled tiny-V4 engine (post-grad backend, the slow part: a trace of the whole
    step) for both compiled-step tests, traced first on a long prompt, before any short one
    runs: (engine, graphs traced by that prompt). A later short step that traced a graph of
    its own would add to that count, which the tests below compare with."""
    from deepinfer import LLM, SamplingParams

    torch._dynamo.reset()  # earlier tests' traces of the same step code must not stand in
    llm = LLM(v4_ckpt, compile=True, compile_backend="post_grad")
    cfg = llm.engine.runner.model.config
    long_prompt = [2 + i % 50 for i in range(cfg.csa_ratio * cfg.index_topk * 3)]  # 3 x topk entries
    llm.generate(
        [long_prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    yield llm, len(llm.engine.runner.forward.post_grad.graphs)
    llm.close()


def test_a_compiled_v4_step_runs_the_cpp_ops_and_agrees_with_eager(compiled_v4, eager_v4):
    """With the CPU's default passes, every routed-experts, Sinkhorn, indexer and RoPE call of
    the tiny V4's compiled step is retargeted (none left to Python), every layer's attention
    core reads its pools through ``sink_attention_rows_cpu``, and its tokens are eager's."""
    from deepinfer import SamplingParams

    llm, _ = compiled_v4
    prompts = [[5, 9, 14, 3, 3, 8], [7, 7, 2, 40, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in eager_v4.generate(prompts, params, use_tqdm=False)]
    compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert compiled == eager
    step = llm.engine.runner.forward
    layers = len(llm.engine.runner.model.layers)
    graphs = step.post_grad.graphs
    twins = (
        torch.ops.deepinfer.routed_experts_cpu.default,
        torch.ops.deepinfer.sinkhorn_cpu.default,
        torch.ops.deepinfer.indexer_topk_cpu.default,
        torch.ops.deepinfer.rope_cpu.default,
    )
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.deepinfer.routed_experts.default not in targets  # none left to Python
    assert torch.ops.deepinfer.sinkhorn.default not in targets
    assert torch.ops.deepinfer.indexer_topk.default not in targets
    assert torch.ops.deepinfer.rope.default not in targets
    # every op of ours the step calls is a C++ one (no Python kernel behind the dispatcher)
    ours = {t.name() for t in targets if isinstance(t, torch._ops.OpOverload) and t.namespace == "deepinfer"}
    cpp_ops = {
        "deepinfer::routed_experts_cpu",
        "deepinfer::sinkhorn_cpu",
        "deepinfer::indexer_topk_cpu",
        "deepinfer::packed_linear",
        "deepinfer::rope_cpu",
        "deepinfer::sink_attention_rows_cpu",
    }
    assert ours <= cpp_ops, ours
    rows_attention = targets.count(torch.ops.deepinfer.sink_attention_rows_cpu.default)
    assert rows_attention == layers == step.pass_manager.counts["use_row_sink_attention"]
    # every layer's latent ran through the C++ RoPE, its queries' RoPE and output de-rotation
    # inside the attention op
    assert targets.count(twins[3]) >= layers
    attention = [
        n
        for g in graphs
        for n in g.graph.nodes
        if n.target == torch.ops.deepinfer.sink_attention_rows_cpu.default
    ]
    assert all(n.args[9] is not None and n.args[11] is not None for n in attention)
    assert sum(targets.count(t) for t in twins) == step.pass_manager.counts["use_native_cpu_ops"]
    # every layer's experts and both of its Sinkhorns ran compiled, as the C++ ops; so did the
    # indexer of every layer that has one
    cfg = llm.engine.runner.model.config
    indexed = sum(1 for kind in cfg.layer_kinds[:layers] if kind == "csa")
    assert targets.count(twins[0]) >= layers and targets.count(twins[1]) >= 2 * layers
    assert indexed and targets.count(twins[2]) >= indexed


def test_a_compiled_v4_step_serves_rows_with_fewer_entries_than_topk(compiled_v4, eager_v4):
    """The indexer op's width is ``topk`` whatever the number of entries, so a step traced on
    long sequences (``compiled_v4``'s first prompt) also serves a prompt shorter than ``topk``
    compressed entries: no new graph (with Inductor, a second compile, the slowest part of
    such a test)."""
    from deepinfer import SamplingParams

    llm, traced = compiled_v4
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    graphs = llm.engine.runner.forward.post_grad.graphs
    assert len(graphs) == traced  # no short step has traced a graph of its own
    short = [o.outputs[0].token_ids for o in llm.generate([[5, 9, 14]], params, use_tqdm=False)]
    assert len(graphs) == traced
    eager = eager_v4.generate([[5, 9, 14]], params, use_tqdm=False)
    assert short == [o.outputs[0].token_ids for o in eager]


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.float64]),  # float64: the Python-op fallbacks
    transposed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_outputs_have_their_fakes_layout_on_every_path(rows, dtype, transposed, seed):
    """A compiled CPU step's C++ wrapper runs without Inductor's size asserts, so each op's
    real output must have the sizes and strides its fake promises, whatever the input layout
    and whichever path (kernel or fallback) runs: the C++ twins and the Python ops alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(seed)

    def strided(*shape: int) -> torch.Tensor:  # the layout under test: a transposed view
        t = torch.randn(*shape, generator=gen, dtype=dtype)
        return t.transpose(0, 1).contiguous().transpose(0, 1) if transposed else t

    w1, w2, w3 = (w.to(dtype) for w in _experts(gen, 4, 16, 16))
    ids, weights = torch.randint(0, 4, (rows, 2), generator=gen), torch.rand(rows, 2)
    q, keys = strided(rows, 3, 8), torch.randn(10, 8, generator=gen, dtype=dtype)
    idx, valid = torch.randint(0, 10, (rows, 6), generator=gen), torch.rand(rows, 6, generator=gen) < 0.7
    experts = (strided(rows, 16), weights, ids, w1, w2, w3, 3.0)
    comb = (strided(rows, 4, 4), 20, 1e-6)
    index = (q, keys, idx, valid, torch.rand(rows, 3).to(dtype), 4, 0.5)
    rope = (strided(rows, 2, 24), torch.randn(rows, 1, 8).to(dtype), torch.randn(rows, 1, 8).to(dtype))
    pool, sink = torch.randn(12, 8, generator=gen, dtype=dtype), torch.randn(3, generator=gen, dtype=dtype)
    attention = (q, pool, idx.clamp(max=11), valid, pool, idx[:, :2], valid[:, :2], sink, 0.5)
    ops = torch.ops.deepinfer
    calls = [  # the C++ twins and the Python ops they stand in for (and fall back to)
        *[(op, experts) for op in (ops.routed_experts_cpu, ops.routed_experts)],
        *[(op, comb) for op in (ops.sinkhorn_cpu, ops.sinkhorn)],
        *[(op, index) for op in (ops.indexer_topk_cpu, ops.indexer_topk)],
        *[(op, rope) for op in (ops.rope_cpu, ops.rope)],
        *[(op, attention) for op in (ops.sink_attention_rows_cpu, ops.sink_attention_rows)],
    ]
    for op, args in calls:
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (real, fake)), strict=True):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), op
