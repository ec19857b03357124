"""QAT fake-quant: formats, idempotence, bounded error, and wiring into the forward."""

from __future__ import annotations

import pytest
import torch
from rounding import assert_equal_up_to_rounding_flips

from deepinfer import load_model
from deepinfer.cache.session import Session
from deepinfer.models.layers.fake_quant import (
    fake_quant_fp4_e4m3_scale,
    fake_quant_fp4_pow2,
    fake_quant_fp8_pow2,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_fp8_pow2_is_idempotent_and_close():
    x = torch.randn(3, 5, 64) * 3
    q = fake_quant_fp8_pow2(x)
    assert torch.equal(fake_quant_fp8_pow2(q), q)
    assert (q - x).abs().max() <= x.abs().max() * 2**-3
    blocks = q.view(3, 5, 2, 32)
    amax = x.view(3, 5, 2, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    assert torch.equal((blocks / scale).to(torch.float8_e4m3fn).float(), blocks / scale)


def test_fp4_pow2_values_lie_on_the_scaled_e2m1_grid():
    x = torch.randn(4, 64)
    q = fake_quant_fp4_pow2(x)
    amax = x.view(4, 2, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    scaled = (q.view(4, 2, 32) / scale).abs()
    assert torch.isin(scaled, E2M1).all()
    assert torch.equal(fake_quant_fp4_pow2(q), q)
    # nearest grid point: error at most half the widest gap (2) times the scale
    assert ((q - x).view(4, 2, 32).abs() <= scale).all()


def test_fp4_e4m3_scale_uses_16_blocks():
    x = torch.randn(2, 48)
    q = fake_quant_fp4_e4m3_scale(x)
    amax = x.view(2, 3, 16).abs().amax(-1, keepdim=True).clamp(min=6 * 2**-9)
    scale = (amax / 6).to(torch.float8_e4m3fn).float()
    assert torch.isin((q.view(2, 3, 16) / scale).abs(), E2M1).all()


def test_dims_not_divisible_by_the_block_are_left_alone():
    x = torch.randn(3, 40)
    assert torch.equal(fake_quant_fp8_pow2(x), x) and torch.equal(fake_quant_fp4_pow2(x), x)


def test_fake_quant_is_wired_into_cached_state_and_chunks_agree(v4_ckpt):
    plain, quant = load_model(v4_ckpt), load_model(v4_ckpt, fake_quant=True)
    ids = torch.randint(0, 258, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = plain(ids).logits
        session = Session(quant, 1, 45)
        b = session.feed(ids)
        assert torch.isfinite(b).all() and (a - b).abs().max() > 1e-3
        checked = 0
        for layer in session.pools:  # what was stored is exactly on the quantised grids
            written = layer.window[:45]  # the one sequence owns blocks 0.. in order
            assert torch.equal(fake_quant_fp8_pow2(written), written)
            if layer.entries is not None and layer.entries.abs().sum() > 0:
                assert torch.equal(fake_quant_fp4_e4m3_scale(layer.entries), layer.entries)
                checked += 1
            if layer.index_keys is not None and layer.index_keys.abs().sum() > 0:
                assert torch.equal(fake_quant_fp4_pow2(layer.index_keys), layer.index_keys)
                checked += 1
        assert checked == 4  # two CSA layers, each with compressed entries and indexer keys
        chunked_session = Session(quant, 1, 45)
        chunked = torch.cat([chunked_session.feed(ids[:, :13]), chunked_session.feed(ids[:, 13:])], 1)
    # A chunk computes its rows with other matrix shapes: isolated values may land one
    # rounding step away (tests/support/rounding.py); a wiring bug moves whole rows.
    for whole, part in zip(session.pools, chunked_session.pools, strict=True):
        assert_equal_up_to_rounding_flips(whole.window[:45], part.window[:45], 1e-6, "window rows")
    assert (chunked - b).abs().max() <= 1e-2


def test_e2m1_rounding_is_nearest_with_ties_to_the_even_code():
    """The arithmetic rounding equals a table search over the grid, midpoints included."""
    from deepinfer.cache.kv_formats import round_e2m1 as _round_e2m1

    mids = (E2M1[1:] + E2M1[:-1]) / 2
    x = torch.cat([torch.linspace(-7, 7, 20001), mids, -mids, E2M1, -E2M1, torch.randn(5000) * 3])
    mag = x.abs().clamp(max=6)
    nearest = (mag.unsqueeze(1) - E2M1).abs()
    best = nearest.min(1, keepdim=True).values
    candidates = (nearest == best).float() * (1 + (torch.arange(8) % 2 == 0).float())  # even codes win ties
    expected = torch.copysign(E2M1[candidates.argmax(1)], x)
    assert torch.equal(_round_e2m1(x), expected)


def test_rounding_flip_check_rejects_real_differences():
    """Mutation check of ``assert_equal_up_to_rounding_flips``: one flipped value passes; a
    shifted row, many flips or a large jump fail."""
    a = fake_quant_fp8_pow2(torch.randn(16, 64))
    one_flip = a.clone()
    one_flip[3, 5] *= 1.125  # one fp8 step
    assert_equal_up_to_rounding_flips(a, one_flip)
    for broken in (torch.roll(a, 1, 0), a * 1.125, a + (torch.arange(64) == 7) * 10.0):
        with pytest.raises(AssertionError):
            assert_equal_up_to_rounding_flips(a, broken)
