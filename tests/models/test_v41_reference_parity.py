"""The engine's DeepSeek-V4.1 model against an independent dense reference (tests/support/v41_reference.py).

The reference is written from the model's published description alone (one-shot prefill, no
cache, fp32) and reads the checkpoint directory itself (safetensors, config.json,
tokenizer.json); the engine model,
loaded by ``load_model``, runs its paged, cached path through ``model(ids)``. Both read the
same tiny random checkpoint: ``deepseek_v41`` (top-k and candidate blocks not saturated past 8
compressed entries, so selection and its tie-breaking matter) and ``deepseek_v41_saturated``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from v41_reference import read_checkpoint, reference_logits

from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint

ARCHS = ("deepseek_v41", "deepseek_v41_saturated")
LENGTHS = (1, 7, 8, 9, 17, 33)
FQ_LENGTHS = (9, 33)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: one intra-op thread is as fast and much steadier on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    """What the reference reads from each checkpoint directory (no deepinfer code)."""
    return {arch: read_checkpoint(path) for arch, path in checkpoints.items()}


@pytest.fixture(scope="module")
def models(checkpoints):
    """Loaded models, one per (arch, fake_quant), built on first use."""
    cache: dict[tuple[str, bool], torch.nn.Module] = {}

    def get(arch: str, fake_quant: bool):
        if (arch, fake_quant) not in cache:
            cache[arch, fake_quant] = load_model(checkpoints[arch], fake_quant=fake_quant)
        return cache[arch, fake_quant]

    return get


def _ids(vocab: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + length)
    return torch.randint(0, vocab, (2, length), generator=gen)


def _both(model, ref, ids: torch.Tensor, fake_quant: bool, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        got = model(ids).logits
    want = reference_logits(ref, ids, fake_quant, **kw)
    assert got.shape == want.shape == (*ids.shape, model.config.vocab_size)
    return got, want


@pytest.mark.parametrize("arch", ARCHS)
def test_one_shot_logits_match_reference(models, references, arch):
    model = models(arch, False)
    for length in LENGTHS:
        got, want = _both(model, references[arch], _ids(model.config.vocab_size, length), False)
        diff = (got - want).abs().max().item()
        print(f"{arch} fake_quant=False S={length}: max |diff| = {diff:.3e}")
        assert diff <= 1e-4, f"S={length}: max |diff| {diff:.3e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_fake_quant_logits_match_reference(models, references, arch):
    model = models(arch, True)
    assert model.config.fake_quant
    for length in FQ_LENGTHS:
        got, want = _both(model, references[arch], _ids(model.config.vocab_size, length), True)
        diff = (got - want).abs().max().item()
        print(f"{arch} fake_quant=True S={length}: max |diff| = {diff:.3e}")
        assert diff <= 1e-3, f"S={length}: max |diff| {diff:.3e}"


def test_same_site_pre_mix_is_not_the_model(models, references):
    """Without the one-site mHC lag (V4-style same-site ``pre``) the logits are far off."""
    model, ref = models("deepseek_v41", False), references["deepseek_v41"]
    ids = _ids(model.config.vocab_size, 17)
    got, lagged = _both(model, ref, ids, False)
    _, same_site = _both(model, ref, ids, False, same_site_pre=True)
    lag_diff = (got - lagged).abs().max().item()
    same_diff = (got - same_site).abs().max().item()
    print(f"lagged reference: {lag_diff:.3e}; same-site reference: {same_diff:.3e}")
    assert lag_diff <= 1e-4
    assert same_diff > 1e-2


def test_unsaturated_checkpoint_exercises_top_k(models):
    """Guard for the first test: the two tiny checkpoints share weights (same seed), so their
    logits differ only where top-k / candidate selection drops entries, which S=33 reaches."""
    unsat, sat = models("deepseek_v41", False), models("deepseek_v41_saturated", False)
    a, b = dict(unsat.state_dict()), dict(sat.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids(unsat.config.vocab_size, 33)
    with torch.no_grad():
        assert (unsat(ids).logits - sat(ids).logits).abs().max().item() > 1e-2
