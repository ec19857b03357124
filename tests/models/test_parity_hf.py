"""Our V4 logits against transformers' DeepseekV4ForCausalLM on the same checkpoint files."""

from __future__ import annotations

import pytest
import torch

from deepinfer import load_model
from deepinfer.models.deepseek_v4_config import CSA, HCA

TOL = 1e-4


def _compare(ours, theirs, batch: int, length: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ours.config.vocab_size, (batch, length), generator=gen)
    with torch.no_grad():
        a = ours(ids).logits
        b = theirs(ids).logits.float()
    assert a.shape == b.shape == (batch, length, ours.config.vocab_size)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("length", [1, 7, 8, 9, 17, 33, 130])
@pytest.mark.parametrize("batch", [1, 3])
def test_logits_match_transformers(v4_ckpt, hf_reference, batch, length):
    ours, theirs = load_model(v4_ckpt), hf_reference(v4_ckpt)
    assert _compare(ours, theirs, batch, length, seed=length) <= TOL


def test_logits_match_past_two_hca_groups(v4_ckpt, hf_reference):
    """Ratio 128: 300 tokens close two groups; ratio 4 and the window of 8 wrap many times."""
    ours, theirs = load_model(v4_ckpt), hf_reference(v4_ckpt)
    assert _compare(ours, theirs, 2, 300, seed=7) <= TOL


@pytest.mark.parametrize("length", [1, 7, 8, 9, 17, 33, 50])
def test_logits_match_transformers_short_groups_sharded(v4_short_ckpt, hf_reference, length):
    ours, theirs = load_model(v4_short_ckpt), hf_reference(v4_short_ckpt)
    assert _compare(ours, theirs, 2, length, seed=100 + length) <= TOL


def test_tiny_configs_cover_every_block_type(v4_ckpt, v4_short_ckpt):
    """Guards the fixtures: if a config loses a block type, the parity tests prove less."""
    cfg = load_model(v4_ckpt).config
    assert {"sliding", CSA, HCA} <= set(cfg.layer_kinds)
    assert cfg.hca_ratio == 128 and cfg.csa_ratio == 4
    assert any(cfg.hash_layers) and not all(cfg.hash_layers)
    assert cfg.n_shared_experts >= 1 and cfg.hc_mult > 1 and cfg.yarn is not None
    # top-k is NOT saturated: at 33 tokens a CSA query sees 8 entries but keeps index_topk
    assert cfg.index_topk < 33 // cfg.csa_ratio
    short = load_model(v4_short_ckpt).config
    assert short.hca_ratio == 8 and short.index_topk >= 50 // short.csa_ratio


def test_parity_is_sensitive_to_the_indexer(v4_ckpt, hf_reference):
    """A perturbed indexer must break parity: the test above is not vacuous."""
    ours, theirs = load_model(v4_ckpt), hf_reference(v4_ckpt)
    csa_layer = ours.config.layer_kinds.index(CSA)
    with torch.no_grad():
        w = ours.layers[csa_layer].attn.indexer.weights_proj.weight
        w.copy_(-w)
    assert _compare(ours, theirs, 1, 40, seed=3) > 1e-2
