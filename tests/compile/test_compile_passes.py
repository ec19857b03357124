"""The compiler's fusion passes (compile_passes/) and the ops they call (kernels/).

Match counts are checked on the post-grad graphs Inductor would lower, produced by
``PostGradBackend`` (no code generation, so seconds per graph); the rewritten graphs run
eagerly and must give the plain model's logits. Each fused op is checked against the plain
PyTorch it replaces, and the Triton kernel under ``TRITON_INTERPRET=1`` on CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer.kernels.fused_moe import fused_moe
from deepinfer.kernels.moe import routed_experts
from deepinfer.kernels.paged_attention import paged_attention
from deepinfer.kernels.sink_attention import sink_attention

from deepinfer.compile.graph_dump import GRAPH_ARCHS, golden_files, trace_tiny
from deepinfer.models.layers.attention import attention_with_sink
from deepinfer.sampling.rejection import acceptance_and_recovery

GOLDEN = Path(__file__).resolve().parents[2] / "fx_graphs"


@pytest.mark.parametrize("arch", GRAPH_ARCHS)
def test_passes_match_every_layer_and_graphs_equal_the_golden_dumps(arch, tmp_path):
    """Counts: one attention core and one MoE per layer of the tiny V4/V4.1 (none on Llama,
    whose attention is the ``paged_attention`` op); the rewritten graph gives the eager
    logits; the before/after text equals ``fx_graphs/`` (regenerate: deepinfer dump-graphs)."""
    traced = trace_tiny(arch, tmp_path)
    assert traced.max_logit_diff <= 1e-4
    assert len(traced.after) == 1, "one graph serves the prefill and the decode step"
    layers = traced.num_layers
    targets = traced.graph_targets[0]
    if arch == "llama":
        assert traced.counts["fuse_sink_attention"] == 0 and traced.counts["fuse_moe"] == 0
        assert targets.count(torch.ops.deepinfer.paged_attention.default) == layers
    else:
        assert traced.counts["fuse_sink_attention"] == layers
        assert traced.counts["fuse_moe"] == layers
        assert targets.count(torch.ops.deepinfer.sink_attention.default) == layers
        assert targets.count(torch.ops.deepinfer.fused_moe.default) == layers
        assert torch.ops.deepinfer.routed_experts.default not in targets
    assert traced.counts["fuse_rejection_sampling"] == 0
    for name, text in golden_files(traced).items():
        committed = (GOLDEN / name).read_text()
        assert text == committed, f"fx_graphs/{name} changed: review the diff, then run deepinfer dump-graphs"


def _probs(gen, *shape):
    return torch.softmax(torch.randn(*shape, generator=gen) * 2, dim=-1)


def _rejection_args(gen, n: int, k: int, v: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of the rejection sampler: target and draft probabilities, drafted ids,
    uniforms and exponential noise for n requests of k drafts over v tokens."""
    return (
        _probs(gen, n, k + 1, v),
        _probs(gen, n, k, v),
        torch.randint(0, v, (n, k), generator=gen),
        torch.rand(n, k, generator=gen),
        torch.empty(n, k + 1, v).exponential_(generator=gen),
    )


def test_verification_pass_fuses_the_rejection_sampler():
    from deepinfer.compile_passes import PASSES

    from deepinfer.compile.compilation import PassManager, PostGradBackend
    from deepinfer.sampling.rejection import rejection_sample

    backend = PostGradBackend(PassManager(PASSES))
    compiled = torch.compile(rejection_sample, backend=backend, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for n, k, v in ((6, 3, 11), (9, 5, 17)):
        args = _rejection_args(gen, n, k, v)
        for got, ref in zip(compiled(*args), rejection_sample(*args), strict=True):
            assert torch.equal(got, ref)
    assert backend.manager.counts["fuse_rejection_sampling"] == 1  # one graph for both shapes


def _visible(gen, t, n):
    vis = torch.rand(t, n, generator=gen) > 0.3
    vis[0] = False  # a row that sees nothing in this part
    return vis


def test_sink_attention_matches_the_plain_form():
    gen = torch.Generator().manual_seed(1)
    t, h, d = 6, 4, 32
    q = torch.randn(t, h, d, generator=gen)
    kv = [torch.randn(t, n, d, generator=gen) for n in (8, 21)]
    vis = [_visible(gen, t, 8), _visible(gen, t, 21)]
    sink = torch.randn(h, generator=gen)
    ref = attention_with_sink(q, list(zip(kv, vis, strict=True)), sink, d**-0.5)
    assert (sink_attention(q, kv, vis, sink, d**-0.5) - ref).abs().max() <= 1e-5
    one = attention_with_sink(q, [(kv[0], vis[0])], sink, d**-0.5)
    assert (sink_attention(q, kv[:1], vis[:1], sink, d**-0.5) - one).abs().max() <= 1e-5


def test_triton_sink_attention_under_the_interpreter():
    """The Triton kernel, run by Triton's interpreter on CPU tensors (a fresh process: the
    interpreter is chosen when triton is imported)."""
    pytest.importorskip("triton")  # a dev dependency; absent only on platforms without wheels
    code = """
import torch
from deepinfer.kernels.sink_attention_triton import sink_attention_triton
from deepinfer.models.layers.attention import attention_with_sink
g = torch.Generator().manual_seed(2)
for t, h, d, lens in ((5, 4, 48, (7, 40)), (3, 2, 16, (33,))):
    q = torch.randn(t, h, d, generator=g)
    kv = [torch.randn(t, n, d, generator=g) for n in lens]
    vis = [torch.rand(t, n, generator=g) > 0.3 for n in lens]
    vis[-1][1] = False
    sink = torch.randn(h, generator=g)
    ref = attention_with_sink(q, list(zip(kv, vis)), sink, d**-0.5)
    err = (sink_attention_triton(q, kv, vis, sink, d**-0.5) - ref).abs().max().item()
    assert err <= 1e-5, err
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("hashed", [False, True])
def test_fused_moe_matches_gate_then_routed_experts(scoring, hashed):
    from deepinfer.kernels.fused_moe import gate_scores

    gen = torch.Generator().manual_seed(4)
    n, d, e, inter, k = 7, 16, 6, 8, 2
    x = torch.randn(n, d, generator=gen)
    logits = torch.randn(n, e, generator=gen)
    bias = torch.randn(e, generator=gen)
    hash_ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if hashed else None
    w1, w3 = torch.randn(e, inter, d, generator=gen), torch.randn(e, inter, d, generator=gen)
    w2 = torch.randn(e, d, inter, generator=gen)
    scale = torch.tensor(2.5)
    for normalize in (True, False):
        scores = gate_scores(logits, scoring)
        ids = hash_ids if hashed else torch.topk(scores + bias, k, dim=-1).indices
        weights = scores.gather(1, ids)
        if normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        ref = routed_experts(x, weights * 2.5, ids, w1, w2, w3, 3.0)
        got = fused_moe(
            x, logits, None if hashed else bias, hash_ids, w1, w2, w3, k, scoring, normalize, scale, 3.0
        )
        assert (got - ref).abs().max() <= 1e-4


def test_new_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(5)
    t, h, d = 4, 2, 8
    q = torch.randn(t, h, d, generator=gen)
    kv = [torch.randn(t, 5, d, generator=gen)]
    torch.library.opcheck(
        torch.ops.deepinfer.sink_attention.default,
        (q, kv, [torch.rand(t, 5, generator=gen) > 0.5], torch.randn(h), 0.3),
    )
    n, e = 5, 4
    torch.library.opcheck(
        torch.ops.deepinfer.fused_moe.default,
        (
            torch.randn(n, d, generator=gen),
            torch.randn(n, e, generator=gen),
            torch.randn(e, generator=gen),
            None,
            torch.randn(e, 3, d, generator=gen),
            torch.randn(e, d, 3, generator=gen),
            torch.randn(e, 3, d, generator=gen),
            2,
            "sigmoid",
            True,
            torch.tensor(1.5),
            5.0,
        ),
    )
    torch.library.opcheck(
        torch.ops.deepinfer.rejection_sample.default,
        (
            _probs(gen, 3, 3, 7),
            _probs(gen, 3, 2, 7),
            torch.randint(0, 7, (3, 2), generator=gen),
            torch.rand(3, 2, generator=gen),
            torch.empty(3, 3, 7).exponential_(generator=gen),
        ),
    )
    pools = torch.randn(20, 2 * d, generator=gen)
    paged_args = (
        torch.randn(3, 4, d, generator=gen),
        pools,
        pools.clone(),
        torch.tensor([2, -1]),  # a decode row and a padded one (all keys masked)
        torch.tensor([[0, 1, 2], [19, 19, 19]]),
        torch.tensor([[True, True, False], [False, False, False]]),
        torch.tensor([[0, 2, 3, 0], [0, 0, 0, 0]]),  # a prefill span and a padded one
        torch.tensor([4, 5, 6, 7, 8]),
    )
    torch.library.opcheck(torch.ops.deepinfer.paged_attention.default, paged_args)
    out = paged_attention(*paged_args)
    assert out.shape == (3, 4, d) and bool(torch.isfinite(out).all())  # padding leaves no NaN behind


def test_rejection_op_equals_the_plain_sampler():
    gen = torch.Generator().manual_seed(6)
    n, k, v = 64, 4, 9
    args = _rejection_args(gen, n, k, v)
    for got, ref in zip(
        torch.ops.deepinfer.rejection_sample(*args), acceptance_and_recovery(*args), strict=True
    ):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_routed_experts_matches_the_reference(dtype):
    """The CUDA kernel of ``routed_experts`` (no host sync, for CUDA graphs) run on the CPU:
    ``torch._grouped_mm`` for bf16, gathered ``bmm`` otherwise; some experts get no rows."""
    from deepinfer.kernels.moe import routed_experts_grouped

    gen = torch.Generator().manual_seed(7)
    n, d, e, inter, k = 9, 32, 6, 16, 2
    x = torch.randn(n, d, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e - 2, generator=gen)[:k] for _ in range(n)])  # experts 4, 5 idle
    weights = torch.rand(n, k, generator=gen)
    w1, w3 = (torch.randn(e, inter, d, generator=gen).to(dtype) for _ in range(2))
    w2 = (torch.randn(e, d, inter, generator=gen) / inter**0.5).to(dtype)
    ref = routed_experts(x, weights, ids, w1, w2, w3, 2.0).float()
    got = routed_experts_grouped(x, weights, ids, w1, w2, w3, 2.0).float()
    assert (got - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 0.05 * ref.abs().max())


def test_small_bmm_pass_rewrites_only_memory_bound_products():
    """Of a stream mix [T,4,4]@[T,4,64] (2 multiply-adds per element), a compute-bound
    [T,128,256]@[T,256,L] (85 at any L) and a product with a symbolic inner size, only the
    first becomes a mul + sum, and every result equals the eager bmm to rounding."""
    from deepinfer.compile_passes import reduce_small_bmm

    from deepinfer.compile.compilation import PassManager, PostGradBackend

    def products(mix, streams, q, keys, probs, values):
        return torch.bmm(mix, streams), torch.bmm(q, keys), torch.bmm(probs, values)

    backend = PostGradBackend(PassManager([reduce_small_bmm]))
    compiled = torch.compile(products, backend=backend, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    length_dims = {3: 2, 4: 2, 5: 1}  # which argument holds L where
    for t, length in ((5, 7), (9, 12)):
        args = (
            torch.randn(t, 4, 4, generator=gen),
            torch.randn(t, 4, 64, generator=gen),
            torch.randn(t, 128, 256, generator=gen),
            torch.randn(t, 256, length, generator=gen),
            torch.randn(t, 4, length, generator=gen),
            torch.randn(t, length, 64, generator=gen),
        )
        for i, x in enumerate(args):  # T and L symbolic, the rest static (as in a model step)
            torch._dynamo.mark_dynamic(x, 0)
            if i in length_dims:
                torch._dynamo.mark_dynamic(x, length_dims[i])
        for got, ref in zip(compiled(*args), products(*args), strict=True):
            assert got.shape == ref.shape
            assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert backend.manager.counts["reduce_small_bmm"] == 1
    (graph,) = backend.graphs
    bmms = [n for n in graph.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert len(bmms) == 2


def test_small_bmm_intensity_bound_is_the_limit_over_symbolic_sizes():
    from deepinfer.compile_passes.small_bmm import intensity_bound

    assert intensity_bound(4, 4, 64) == pytest.approx(4 * 4 * 64 / (16 + 256 + 256))
    assert intensity_bound(4, 64, "L") == pytest.approx(4 * 64 / 68)  # L -> inf
    assert intensity_bound("T", 4, "L") == float("inf")
    for m, k in ((4, 64), (128, 512), (1, 3)):
        big = intensity_bound(m, k, 10**9)  # the limit is approached from below
        assert big <= intensity_bound(m, k, "L") + 1e-6
        assert big == pytest.approx(intensity_bound(m, k, "L"), rel=1e-6)


def test_attention_pass_matches_the_form_inductors_own_compile_leaves():
    """Inductor's own compile (unlike ``PostGradBackend``) leaves the mask's fill as
    ``full([], -inf)``, the sink's view as a reshape, and the gathered keys read by two
    separate reshapes of one node; the pass must still find the core, and the fused op must
    give the plain form's output."""
    from deepinfer.compile_passes import fuse_sink_attention
    from torch.fx.experimental.proxy_tensor import make_fx

    t, h, length, d = 5, 4, 6, 16

    def core(q, flat_kv, visible, sink):
        keys = flat_kv.reshape(t, length, d)
        values = flat_kv.reshape(t, length, d)  # a second node for the same tensor
        fill = torch.full((), float("-inf"))
        scores = torch.where(visible.unsqueeze(1), torch.bmm(q, keys.permute(0, 2, 1)) * 0.25, fill)
        logits = torch.cat([scores, sink.reshape(1, -1, 1).expand(t, h, 1)], dim=-1)
        shifted = (logits - logits.amax(dim=-1, keepdim=True)).exp()
        probs = shifted / shifted.sum(dim=-1, keepdim=True)
        return torch.bmm(probs[:, :, :length], values)

    gen = torch.Generator().manual_seed(0)
    args = (
        torch.randn(t, h, d, generator=gen),
        torch.randn(t * length * d, generator=gen),
        torch.rand(t, length, generator=gen) < 0.7,
        torch.randn(h, generator=gen),
    )
    gm = make_fx(core)(*args)
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.full.default in targets and torch.ops.aten.scalar_tensor.default not in targets
    assert fuse_sink_attention(gm.graph) == 1
    gm.recompile()
    assert torch.ops.deepinfer.sink_attention.default in {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.bmm.default not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(*args), core(*args), rtol=1e-5, atol=1e-5)
