"""``deepinfer::packed_linear`` (kernels/cpu/linear_op.py) and the pass that inserts it.

The op multiplies on a registered weight's packed copy while that copy is current and is
``aten::mm`` otherwise; these tests check its values against ``x @ W.T`` on generated shapes,
that a row's result does not depend on the rows batched with it, that an in-place write or a
freed weight never leaves a stale copy in use, and that the pass rewrites weight projections
but not products of two activations."""

from __future__ import annotations

import gc

import pytest
import torch
from deepinfer.kernels.cpu import build as cpu_build
from deepinfer.kernels.cpu import linear_op as cpu_linear_op
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import needs_compiler, require

pytestmark = needs_compiler


@pytest.fixture(autouse=True, scope="module")
def _the_op_built() -> None:
    """A compile error fails these tests; only a machine without a compiler skips them."""
    require(cpu_linear_op.available(), "the packed-linear op")


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 70) | st.integers(90, 260),  # the kernel's rows-first order from 96 rows
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_linear_is_x_times_w_transposed(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    calls = cpu_linear_op.packed_calls()
    assert torch.equal(cpu_linear_op.packed_linear(x, weight), x @ weight.T)  # unregistered: aten::mm
    some_bias = torch.randn(n, generator=gen)
    assert torch.equal(cpu_linear_op.packed_linear(x, weight, some_bias), torch.addmm(some_bias, x, weight.T))
    assert cpu_linear_op.packed_calls() == calls
    cpu_linear_op.register(weight)
    got = cpu_linear_op.packed_linear(x, weight)
    assert cpu_linear_op.packed_calls() == calls + 1
    ref = (x.double() @ weight.double().T).float()
    assert got.shape == (m, n)
    assert (got - ref).abs().max() <= 1e-5 * k**0.5 * max(ref.abs().max().item(), 1.0)
    # each row is one FMA chain whatever else is in the batch: bitwise equal alone
    row = int(torch.randint(m, (1,), generator=gen))
    assert torch.equal(cpu_linear_op.packed_linear(x[row : row + 1], weight)[0], got[row])
    bias = torch.randn(n, generator=gen)
    assert torch.equal(cpu_linear_op.packed_linear(x, weight, bias), got + bias)  # the kernel adds it last
    # a strided input (a column slice) reads the same values
    wide = torch.cat([x, torch.randn(m, 3, generator=gen)], dim=1)
    assert torch.equal(cpu_linear_op.packed_linear(wide[:, :k], weight), got)


def test_a_weight_written_in_place_is_never_read_from_its_stale_copy():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(9, 40, generator=gen), torch.randn(33, 40, generator=gen)
    cpu_linear_op.register(weight)
    before = cpu_linear_op.packed_linear(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)
    calls = cpu_linear_op.packed_calls()
    assert torch.equal(cpu_linear_op.packed_linear(x, weight), x @ weight.T)  # stale: aten::mm
    assert cpu_linear_op.packed_calls() == calls
    cpu_linear_op.register(weight)  # packed again from the new values
    assert torch.equal(cpu_linear_op.packed_linear(x, weight), 2.0 * before)  # x2 is exact in fp32
    assert cpu_linear_op.packed_calls() == calls + 1


def test_a_freed_weights_copy_is_dropped_and_never_reused_at_its_address():
    gen = torch.Generator().manual_seed(2)
    cpu_linear_op.register(torch.randn(8, 16, generator=gen))  # sweeps earlier freed weights
    held = cpu_linear_op.registered()
    weight = torch.randn(64, 16, generator=gen)
    cpu_linear_op.register(weight)
    assert cpu_linear_op.registered() <= held + 1
    address = weight._cdata  # the TensorImpl the registry is keyed by
    del weight
    gc.collect()
    # the entry's weak reference keeps the freed TensorImpl's memory until the entry goes, so
    # no new tensor can take its address meanwhile (a bare tensor would: malloc reuses it)
    fresh = [torch.randn(64, 16, generator=gen) for _ in range(50)]
    assert all(t._cdata != address for t in fresh)
    fresh = fresh[0]
    x = torch.randn(5, 16, generator=gen)
    calls = cpu_linear_op.packed_calls()
    assert torch.equal(cpu_linear_op.packed_linear(x, fresh), x @ fresh.T)
    assert cpu_linear_op.packed_calls() == calls
    cpu_linear_op.register(torch.randn(8, 16, generator=gen))
    assert cpu_linear_op.registered() <= held + 1  # the freed weight's copy went


def test_a_weight_replaced_through_data_is_never_read_from_its_stale_copy():
    """``p.data = t`` swaps the storage without a version bump: the storage check catches it."""
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(5, 24, generator=gen), torch.nn.Parameter(torch.randn(40, 24, generator=gen))
    cpu_linear_op.register(weight)
    calls = cpu_linear_op.packed_calls()
    weight.data = torch.randn(40, 24, generator=gen)
    with torch.no_grad():
        assert torch.equal(cpu_linear_op.packed_linear(x, weight), x @ weight.T)
    assert cpu_linear_op.packed_calls() == calls


def test_the_pass_leaves_graphs_alone_where_the_op_did_not_build(monkeypatch):
    from deepinfer.compile_passes import use_packed_linear

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(torch.ops.aten.mm.default, (x, w)))
    monkeypatch.setattr(cpu_linear_op, "available", lambda: False)
    assert use_packed_linear(graph) == 0


def test_register_refuses_what_it_cannot_pack():
    with pytest.raises(RuntimeError, match="2-D fp32"):
        cpu_linear_op.register(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D fp32"):
        cpu_linear_op.register(torch.randn(4))
    with torch.inference_mode():
        frozen = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="inference tensor"):
        cpu_linear_op.register(frozen)
    x = torch.randn(3, 4)
    assert torch.equal(cpu_linear_op.packed_linear(x, frozen), x @ frozen.T)


def test_the_pass_rewrites_weight_projections_only():
    """In a compiled function, ``F.linear`` of an input weight, with a bias or not, and an
    ``addmm`` with a 2-D addend become the op; a product of two computed tensors stays ``mm``;
    the results match eager."""
    from deepinfer.compile_passes import use_packed_linear

    from deepinfer.compile.compilation import PassManager, PostGradBackend

    def f(x, weight, other, weight2, bias) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projected = torch.nn.functional.linear(x, weight)
        computed = torch.relu(other)
        residual = torch.addmm(computed[:6, :9], x, weight2.T)  # a 2-D addend
        return projected, projected @ computed.T, torch.nn.functional.linear(x, weight2, bias) + residual

    backend = PostGradBackend(PassManager([use_packed_linear]))
    compiled = torch.compile(f, backend=backend, dynamic=False)
    gen = torch.Generator().manual_seed(3)
    x, weight, other = (
        torch.randn(6, 24, generator=gen),
        torch.randn(40, 24, generator=gen),
        torch.randn(7, 40),
    )
    weight2, bias = torch.randn(9, 24, generator=gen), torch.randn(9, generator=gen)
    cpu_linear_op.register(weight)
    cpu_linear_op.register(weight2)
    calls = cpu_linear_op.packed_calls()
    args = (x, weight, other, weight2, bias)
    for got, ref in zip(compiled(*args), f(*args), strict=True):
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert backend.manager.counts["use_packed_linear"] == 3
    assert cpu_linear_op.packed_calls() == calls + 3
    (graph,) = backend.graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.deepinfer.packed_linear.default) == 3
    assert targets.count(torch.ops.aten.mm.default) == 1
    assert targets.count(torch.ops.aten.addmm.default) == 0


def test_a_v4_model_registers_its_projections_but_not_experts_or_tables(v4_ckpt):
    """nn.Linear weights, the mHC mixing functions and the router; never routed experts,
    embeddings or the compressor's position table."""
    from deepinfer.models.loading import load_model

    model = load_model(v4_ckpt)
    count = model.register_packed_projections()
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    names = [
        name
        for name, p in model.named_parameters()
        if p.dim() == 2
        and ".experts." not in f".{name}"
        and (id(p) in linear or name.rsplit(".", 1)[-1].startswith("hc_") or name.endswith("gate.weight"))
    ]
    assert count == len(names) > 0
    assert not any(name.endswith(("embed.weight", "ape")) for name in names)
    x = torch.randn(3, model.head.weight.shape[1])
    calls = cpu_linear_op.packed_calls()
    head = cpu_linear_op.packed_linear(x, model.head.weight)
    assert cpu_linear_op.packed_calls() == calls + 1
    assert torch.allclose(head, x @ model.head.weight.T, rtol=1e-5, atol=1e-5)


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    """A killed build leaves PyTorch's builder a lock it would wait on forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_build.drop_stale_lock(lock)
    assert lock.exists()  # a build may be running
    old = time.time() - cpu_build.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_build.drop_stale_lock(lock)
    assert not lock.exists()
    cpu_build.drop_stale_lock(lock)  # none: nothing to do
