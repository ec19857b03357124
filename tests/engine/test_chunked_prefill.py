"""Chunked prefill at odd split points followed by decode equals the one-shot forward."""

from __future__ import annotations

import pytest
import torch

from deepinfer import load_model
from deepinfer.cache.session import Session

TOL = 1e-4


def _incremental(model, ids: torch.Tensor, splits: list[int], decode_steps: int) -> torch.Tensor:
    session = Session(model, ids.shape[0], ids.shape[1])
    prefill_end = ids.shape[1] - decode_steps
    outs, prev = [], 0
    for cut in [*splits, prefill_end]:
        outs.append(session.feed(ids[:, prev:cut]))
        prev = cut
    for t in range(prefill_end, ids.shape[1]):
        outs.append(session.feed(ids[:, t : t + 1]))
    assert session.num_tokens == ids.shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("splits", [[1], [3, 5], [7, 9, 21], [13, 14, 15, 16, 33]])
@pytest.mark.parametrize("fixture", ["v4_ckpt", "v4_short_ckpt", "v41_ckpt"])
def test_chunked_prefill_then_decode_matches_one_shot(request, fixture, splits):
    """V4.1 runs with its QAT fake-quant off here: chunking moves fp32 sums by ~1e-7, which can
    flip a quantisation step; ``test_v41_chunked_with_fake_quant`` measures that case."""
    model = load_model(request.getfixturevalue(fixture), fake_quant=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 52), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        got = _incremental(model, ids, splits, decode_steps=12)
    assert (got - full).abs().max().item() <= TOL


def test_v41_chunked_with_fake_quant(v41_ckpt):
    """With the fake-quant on (V4.1's default), chunked prefill + decode still agrees."""
    model = load_model(v41_ckpt)
    ids = torch.randint(0, model.config.vocab_size, (2, 52), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (_incremental(model, ids, [5, 17, 18], decode_steps=12) - model(ids).logits).abs().max().item()
    print(f"V4.1 fake-quant on: chunked vs one-shot max abs diff {diff:.3g}")
    assert diff <= TOL


def test_decode_past_hca_group_boundary(v4_ckpt):
    """Decode steps that close ratio-128 groups (positions 127 and 255) agree with one shot."""
    model = load_model(v4_ckpt)
    ids = torch.randint(0, model.config.vocab_size, (1, 262), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = model(ids).logits
        session = Session(model, 1, 262)
        outs = [session.feed(ids[:, :120])]
        outs += [session.feed(ids[:, t : t + 1]) for t in range(120, 140)]
        outs.append(session.feed(ids[:, 140:250]))
        outs += [session.feed(ids[:, t : t + 1]) for t in range(250, 262)]
    assert (torch.cat(outs, 1) - full).abs().max().item() <= TOL


def test_session_rejects_wrong_batch_and_overflow(v4_ckpt):
    model = load_model(v4_ckpt)
    session = Session(model, 2, 20)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        session.feed(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="capacity"):
        session.feed(torch.ones(2, 200, dtype=torch.long))
