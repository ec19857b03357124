"""Fast kernel paths agree with their reference definitions."""

from __future__ import annotations

import torch
from deepinfer.kernels.sinkhorn import _numpy, reference, sinkhorn


def test_numpy_sinkhorn_matches_reference():
    logits = torch.randn(37, 4, 4, generator=torch.Generator().manual_seed(0)) * 3
    ref = reference(logits, 20, 1e-6)
    assert torch.allclose(_numpy(logits, 20, 1e-6), ref, atol=1e-6)
    assert torch.allclose(sinkhorn(logits, 20, 1e-6), ref, atol=1e-6)
    # the loop ends on a column normalisation: columns sum to 1 (rows only approach it)
    assert torch.allclose(ref.sum(-2), torch.ones(37, 4), atol=1e-5)


def test_sinkhorn_rows_do_not_depend_on_the_batch():
    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sinkhorn(logits, 20, 1e-6)[5:6], sinkhorn(logits[5:6], 20, 1e-6))


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
