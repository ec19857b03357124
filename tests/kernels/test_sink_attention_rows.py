"""``deepinfer::sink_attention_rows`` (kernels/sink_attention_rows.py), its C++ twin
``sink_attention_rows_cpu`` (kernels/cpu/step_ops.py) and the pass that puts the twin into
compiled CPU steps (compile_passes/row_attention.py).

The Python op is the formula: gather each part's rows, then ``sink_attention``'s reference,
which the model's ``attention_with_sink`` equals. The C++ kernel sums in another order, so it
is compared within rounding on generated shapes; what must hold exactly is that a row's result
does not depend on the other rows or the thread count (the engine's batched == alone), and
that inputs the kernel does not take reach the Python op."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.cpu import step_ops as cpu_step_ops
from deepinfer.kernels.sink_attention_rows import sink_attention_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import needs_compiler, require

from deepinfer.models.layers.attention import attention_with_sink
from deepinfer.models.layers.gather import gather_rows

pytestmark = needs_compiler


@pytest.fixture(autouse=True, scope="module")
def _the_ops_built() -> None:
    """A compile error fails these tests; only a machine without a compiler skips them."""
    require(cpu_step_ops.available(), "the C++ step ops")


def _case(gen: torch.Generator, t: int, h: int, d: int, lens: list[int], dtype=torch.float32) -> tuple:
    """q, the parts' (pool, idx, visible) flattened with None for a missing part, sink."""
    q = torch.randn(t, h, d, generator=gen, dtype=dtype)
    parts: list[torch.Tensor | None] = []
    for length in lens:
        n = int(torch.randint(1, 50, (), generator=gen))
        pool = torch.randn(n, d, generator=gen, dtype=dtype) * 2
        idx = torch.randint(0, n, (t, length), generator=gen)
        visible = torch.rand(t, length, generator=gen) < float(torch.rand((), generator=gen))
        parts += [pool, idx, visible]
    parts += [None] * (3 * (2 - len(lens)))
    sink = torch.randn(h, generator=gen, dtype=dtype)
    return (q, *parts, sink)


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(0, 40),
    h=st.integers(1, 5),
    d=st.sampled_from([1, 8, 16, 40, 64, 72]),
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_kernel_computes_the_formula(t, h, d, lens, seed):
    """The C++ op equals the Python op (the formula) within fp32 rounding, and the formula is
    the model's ``attention_with_sink`` over the gathered parts: rows with no visible key
    (only the sink: zeros), vector tails of the head size and of the key count included."""
    gen = torch.Generator().manual_seed(seed)
    args = _case(gen, t, h, d, lens)
    scale = d**-0.5
    want = sink_attention_rows(*args, scale)
    got = torch.ops.deepinfer.sink_attention_rows_cpu(*args, scale)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    q, sink = args[0], args[-1]
    parts = [
        (gather_rows(pool, idx), visible)
        for pool, idx, visible in zip(args[1:-1:3], args[2:-1:3], args[3:-1:3], strict=True)
        if pool is not None
    ]
    torch.testing.assert_close(attention_with_sink(q, parts, sink, scale), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 30),
    h=st.integers(1, 5),
    d=st.sampled_from([8, 40, 64]),
    half=st.integers(1, 4),
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    rotate=st.sampled_from(["q", "out", "both"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_folded_rope_gives_the_bits_of_the_rope_calls_around_the_kernel(t, h, d, half, lens, rotate, seed):
    """The queries' RoPE and the output's de-rotation folded into the kernel give exactly
    ``rope_cpu`` before and after the kernel (bitwise), and the formula's result within
    rounding: RoPE tables of one row per token, [T, 1, half]."""
    gen = torch.Generator().manual_seed(seed)
    args = _case(gen, t, h, d, lens)
    cos, sin = torch.randn(t, 1, half, generator=gen), torch.randn(t, 1, half, generator=gen)
    tables = [cos, sin, cos, -sin]
    if rotate == "q":
        tables[2:] = [None, None]
    elif rotate == "out":
        tables[:2] = [None, None]
    ops = torch.ops.deepinfer
    q = args[0] if tables[0] is None else ops.rope_cpu(args[0], cos, sin)
    want = ops.sink_attention_rows_cpu(q, *args[1:], 0.3)
    if tables[2] is not None:
        want = ops.rope_cpu(want, cos, -sin)
    got = ops.sink_attention_rows_cpu(*args, 0.3, *tables)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, sink_attention_rows(*args, 0.3, *tables), rtol=1e-5, atol=1e-5)


def test_a_wrong_kernel_fails_the_comparison():
    """The mutation check of the comparison above: the formula without its sink, or with one
    key's visibility flipped, is outside its tolerance on a generated case."""
    gen = torch.Generator().manual_seed(3)
    q, p0, i0, v0, p1, i1, v1, sink = _case(gen, 8, 4, 64, [8, 4])
    got = torch.ops.deepinfer.sink_attention_rows_cpu(q, p0, i0, v0, p1, i1, v1, sink, 0.125)
    no_sink = sink_attention_rows(q, p0, i0, v0, p1, i1, v1, torch.full_like(sink, -1e30), 0.125)
    flipped = v0.clone()
    flipped[0, 0] = ~flipped[0, 0]
    other_key = sink_attention_rows(q, p0, i0, flipped, p1, i1, v1, sink, 0.125)
    for wrong in (no_sink, other_key):
        assert not torch.allclose(got, wrong, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(2, 300),
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_rows_result_is_the_same_alone_batched_and_on_any_thread_count(t, lens, seed):
    """Bitwise: each row's output alone equals its row in the batch, on one thread and on
    two (the engine's batched == alone rests on this)."""
    gen = torch.Generator().manual_seed(seed)
    q, *parts, sink = _case(gen, t, 4, 64, lens)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = torch.ops.deepinfer.sink_attention_rows_cpu(q, *parts, sink, 0.125)
        torch.set_num_threads(1)
        one_thread = torch.ops.deepinfer.sink_attention_rows_cpu(q, *parts, sink, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, one_thread)
    for row in {0, t // 2, t - 1}:
        alone_parts = [p if p is None or i % 3 == 0 else p[row : row + 1] for i, p in enumerate(parts)]
        alone = torch.ops.deepinfer.sink_attention_rows_cpu(q[row : row + 1], *alone_parts, sink, 0.125)
        assert torch.equal(alone[0], batched[row])


def test_inputs_the_kernel_does_not_take_reach_the_formula():
    """fp64 tensors go to the Python op through the dispatcher (the same bits as calling it)."""
    gen = torch.Generator().manual_seed(5)
    args = _case(gen, 6, 2, 16, [5, 3], dtype=torch.float64)
    assert torch.equal(
        torch.ops.deepinfer.sink_attention_rows_cpu(*args, 0.25), sink_attention_rows(*args, 0.25)
    )


def test_a_visible_key_outside_its_pool_is_an_index_error_and_a_hidden_one_is_ignored():
    gen = torch.Generator().manual_seed(6)
    q, p0, i0, v0, p1, i1, v1, sink = _case(gen, 4, 2, 16, [3])
    v0 = torch.ones_like(v0)
    i0 = i0.clone()
    i0[1, 2] = p0.shape[0]  # one past the pool
    with pytest.raises(IndexError, match="outside their pool"):
        torch.ops.deepinfer.sink_attention_rows_cpu(q, p0, i0, v0, p1, i1, v1, sink, 0.5)
    v0[1, 2] = False  # hidden: never read
    out = torch.ops.deepinfer.sink_attention_rows_cpu(q, p0, i0, v0, p1, i1, v1, sink, 0.5)
    i0[1, 2] = 0
    torch.testing.assert_close(out, sink_attention_rows(q, p0, i0, v0, p1, i1, v1, sink, 0.5))


def _compiled_core(
    lens: list[int], pool_dtype: torch.dtype = torch.float32, raw_out: bool = False, run_pass: bool = True
):
    """The model's gathers and ``attention_with_sink`` compiled through ``PostGradBackend``
    with only this pass (real post-grad graphs, run without code generation), its
    arguments and the backend."""
    from deepinfer.compile_passes import use_row_sink_attention

    from deepinfer.compile.compilation import PassManager, PostGradBackend
    from deepinfer.models.layers.rope import apply_rope

    def core(q, sink, cos, sin, *parts):  # as LatentAttention.project / attend write it
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        gathered = [
            (gather_rows(pool, idx).to(q.dtype), visible)
            for pool, idx, visible in zip(parts[0::3], parts[1::3], parts[2::3], strict=True)
        ]
        out = attention_with_sink(q, gathered, sink, 0.125)
        rotated = apply_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        return (rotated, out * 2) if raw_out else rotated

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, *parts, sink = _case(gen, 6, 4, 64, lens)
    parts = [p.to(pool_dtype) if i % 3 == 0 else p for i, p in enumerate(parts) if p is not None]
    cos, sin = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    for x in (q, cos, sin, *parts[1::3], *parts[2::3]):  # rows symbolic, as in a model step
        torch._dynamo.mark_dynamic(x, 0)
    backend = PostGradBackend(PassManager([use_row_sink_attention] if run_pass else []))
    return torch.compile(core, backend=backend), core, (q, sink, cos, sin, *parts), backend


@pytest.mark.parametrize("lens", [[8], [8, 4]])
def test_the_pass_puts_the_kernel_in_place_of_gather_and_attention(lens):
    """Each core over gathered fp32 parts becomes one ``sink_attention_rows_cpu`` call reading
    the pools and indices (no gather, no ``bmm`` left) with the queries' RoPE and the output's
    de-rotation folded in (no RoPE call left), with the result unchanged."""
    compiled, core, args, backend = _compiled_core(lens)
    torch.testing.assert_close(compiled(*args), core(*args), rtol=1e-5, atol=1e-5)
    assert backend.manager.counts["use_row_sink_attention"] == 1
    targets = {n.target for g in backend.graphs for n in g.graph.nodes}
    assert torch.ops.deepinfer.sink_attention_rows_cpu.default in targets
    assert torch.ops.deepinfer.rope.default not in targets
    assert not targets & {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_select.default,
        torch.ops.aten.bmm.default,
    }


def test_an_output_read_before_its_de_rotation_keeps_the_rope_call():
    """Where something else reads the attention output unrotated, the de-rotation stays a
    call of its own (folding it would hand that reader rotated values); the queries' RoPE is
    still folded."""
    compiled, core, args, backend = _compiled_core([8, 4], raw_out=True)
    for got, want in zip(compiled(*args), core(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (op,) = [
        n
        for g in backend.graphs
        for n in g.graph.nodes
        if n.target == torch.ops.deepinfer.sink_attention_rows_cpu.default
    ]
    assert op.args[9] is not None and op.args[11] is None


def test_the_pass_leaves_cores_over_other_parts_alone(monkeypatch):
    """A part read from a bf16 pool (converted after its gather) keeps the plain graph; so
    does every graph where the ops did not build."""
    from deepinfer.compile_passes import use_row_sink_attention

    compiled, core, args, backend = _compiled_core([8, 4], pool_dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(*args), core(*args), rtol=1e-5, atol=1e-5)
    assert backend.manager.counts["use_row_sink_attention"] == 0
    compiled, core, args, backend = _compiled_core([8, 4], run_pass=False)
    compiled(*args)
    (graph,) = backend.graphs  # an fp32 core the pass would take
    with monkeypatch.context() as patch:
        patch.setattr(cpu_step_ops, "available", lambda: False)
        assert use_row_sink_attention(graph.graph) == 0
    assert use_row_sink_attention(graph.graph) == 1
