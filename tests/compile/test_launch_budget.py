"""A launch budget per decode layer on the CUDA code path, counted on the CPU
(``compile/launch_count.py``): each tiny config's mean launches per layer stay within its
budget. The counter is shown to count a known function exactly, custom ops as their CUDA
kernels and Triton launches as one each; and an unfused variant (Sinkhorn's reference, one of
Llama's fused kernels switched off) or one extra op per norm pushes a config past its budget,
so the budget check would fail."""

from __future__ import annotations

import pytest
import torch

from deepinfer.compile import launch_count
from deepinfer.compile.launch_count import count_decode_launches, count_launches, meta_model
from deepinfer.models.layers import norms
from deepinfer.tiny import make_tiny_checkpoint

pytest.importorskip("triton")  # the CUDA path counted is the one with the Triton kernels

META = torch.device("meta")

# Mean launches per decoder layer of one eager decode step of the tiny configs. The targets
# are 30 (V4) and 12 (Llama); these are what the fused kernels reach, with one launch of
# margin (``benchmarks/launch_budget.py`` prints the counts and what the rest is made of).
BUDGETS = {"deepseek_v4": 81, "deepseek_v41": 90, "llama": 13}
# Llama's fused ops (one Triton launch each on CUDA) and the launches per layer their
# reference costs over that one
LLAMA_FUSED = {
    "deepinfer::paged_decode_attention": 2,
    "deepinfer::rope_store": 2,
    "deepinfer::add_rms_norm": 2,
    "deepinfer::silu_and_mul": 1,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("launch_budget")
    return {arch: meta_model(make_tiny_checkpoint(root / arch, arch=arch)) for arch in BUDGETS}


def within_budget(arch: str, count: launch_count.LaunchCount) -> bool:
    return count.per_layer_mean <= BUDGETS[arch]


@pytest.mark.parametrize("arch", sorted(BUDGETS))
def test_decode_step_stays_within_its_launch_budget(arch, models):
    count = count_decode_launches(models[arch])
    assert within_budget(arch, count), (
        f"{arch}: {count.per_layer_mean:.1f} launches per layer > budget {BUDGETS[arch]}; "
        f"by op: {count.by_op().most_common(12)}"
    )
    assert len(count.per_layer) == models[arch].config.num_hidden_layers
    assert count.total == count.layer_total + sum(count.outside.values())


def test_counter_counts_a_known_function_exactly():
    """Views, allocations and host work launch nothing; composite ops count as the kernels
    they become (``linear`` of a 2-D input: a transpose view and one ``mm``)."""
    x = torch.ones(4, 8, device=META)
    w = torch.ones(3, 8, device=META)
    host = torch.arange(4)

    def known(x, w):
        y = torch.nn.functional.linear(x, w)  # t (view) + mm: 1
        y = y.view(2, 6).transpose(0, 1).unsqueeze(0)  # views: 0
        z = torch.empty_like(y)  # allocation: 0
        z.copy_(y)  # 1
        _ = host * 2  # host: 0
        return (z.relu() + 1).sum()  # 3

    count = count_launches(known, x, w)
    assert count.outside == {"mm": 1, "copy_": 1, "relu": 1, "add": 1, "sum": 1}
    assert count.total == 5


def test_custom_ops_count_their_cuda_kernel():
    """``deepinfer::sinkhorn`` counts one Triton launch; with its CUDA kernel off, the
    reference's 2 * iters + 3 normalisation launches."""
    from deepinfer.kernels.sinkhorn import sinkhorn_op

    comb = torch.ones(7, 4, 4, device=META)
    fused = count_launches(sinkhorn_op, comb, 20, 1e-6)
    assert fused.outside == {"triton:_sinkhorn": 1}
    with launch_count.kernels_disabled(["deepinfer::sinkhorn"]):
        unfused = count_launches(sinkhorn_op, comb, 20, 1e-6)
    assert unfused.total == 3 + 6 * 19 + 2  # softmax, +eps, first columns; 19 rounds; two more of the first
    assert count_launches(sinkhorn_op, comb, 20, 1e-6).total == 1  # switched back on


# V4's fused ops (both V4 archs run them) and V4.1's own (its QAT fake quantisation, which
# V4 leaves off)
V4_FUSED = [
    "deepinfer::hc_pre",
    "deepinfer::hc_post",
    "deepinfer::moe_gate",
    "deepinfer::interleaved_rope",
    "deepinfer::compress_groups",
]
V41_FUSED = ["deepinfer::fake_quant"]


@pytest.mark.parametrize(
    ("op", "archs"),
    [pytest.param(op, ("deepseek_v4", "deepseek_v41"), id=op) for op in V4_FUSED]
    + [pytest.param(op, ("deepseek_v41",), id=op) for op in V41_FUSED],
)
def test_each_unfused_v4_kernel_breaks_the_v4_budgets(op, archs, models):
    """Mutation check: with one of the fused kernels switched off (an mHC site's mixing,
    Sinkhorn and collapse; its expand; the router; the RoPE rotations; a compressor's state
    writes and pooling; V4.1's fake quantisation), the count exceeds the budget of each arch
    that runs it."""
    for arch in archs:
        with launch_count.kernels_disabled([op]):
            count = count_decode_launches(models[arch])
        assert not within_budget(arch, count), (op, arch, count.per_layer_mean)


def test_an_extra_op_per_norm_breaks_every_budget(models, monkeypatch):
    """Mutation check: one more launch in each norm (an unfused scale) is caught for each
    config."""
    fused, fused_add = norms.rms_norm, norms.add_rms_norm

    def with_extra_op(x, weight, eps):
        return fused(x, weight, eps) * 1.0

    def add_with_extra_op(x, residual, weight, eps):
        total, normed = fused_add(x, residual, weight, eps)
        return total, normed * 1.0

    monkeypatch.setattr(norms, "rms_norm", with_extra_op)
    monkeypatch.setattr(norms, "add_rms_norm", add_with_extra_op)
    for arch in BUDGETS:
        count = count_decode_launches(models[arch])
        assert not within_budget(arch, count), (arch, count.per_layer_mean)


@pytest.mark.parametrize("op", sorted(LLAMA_FUSED))
def test_each_unfused_llama_kernel_costs_launches(op, models):
    """Mutation check: with one of Llama's fused kernels switched off (its reference on CUDA),
    each layer makes at least the launches that reference adds; those that add two or more
    push Llama past its budget. (SiLU-and-mul's reference is two launches, one over the
    margin: the step with it off sits at the budget.)"""
    fused = count_decode_launches(models["llama"])
    with launch_count.kernels_disabled([op]):
        count = count_decode_launches(models["llama"])
    assert count.per_layer_mean >= fused.per_layer_mean + LLAMA_FUSED[op], (op, count.by_op())
    assert within_budget("llama", count) == (LLAMA_FUSED[op] < 2), (op, count.per_layer_mean)


def test_layers_are_counted_apart_from_embedding_and_head(models):
    count = count_decode_launches(models["llama"])
    assert count.outside["embedding"] == 1
    assert all(layer == count.per_layer[0] for layer in count.per_layer)
