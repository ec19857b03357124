"""The drafter check the GPU run makes (gpu_tests/drafter_check.py), on the CPU: every
drafter drafts under its options, and the speculative engine's greedy tokens equal the plain
engine's. Mutations: the options the check once used (logprobs asked for, adaptive drafting
on) draft nothing or less, and a verifier that accepts every draft changes the tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deepinfer.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_tests"))
from drafter_check import METHODS, check_drafter  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {arch: make_tiny_checkpoint(root / arch, arch=arch) for arch in METHODS}


@pytest.mark.parametrize("arch", list(METHODS))
def test_each_drafter_drafts_and_keeps_greedy_tokens(arch, checkpoints):
    result = check_drafter(checkpoints[arch], METHODS[arch])
    assert result.drafted > 0
    assert result.tokens("spec") == result.tokens("plain")
    if METHODS[arch] == "ngram":  # the repeating prompts' lookups are right most of the time
        assert result.accepted > 0
    # mutation: asking for logprobs makes every request ineligible (``can_draft``)
    assert check_drafter(checkpoints[arch], METHODS[arch], logprobs=2).drafted == 0


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_adaptive_drafting_verifies_fewer_drafts_in_a_closed_batch(arch, checkpoints):
    """The other old option: with equal budgets in ``LLM.generate``'s closed batch, the
    adaptive rule verifies drafts only where they could shorten the batch, so a model
    drafter whose random drafts are rejected verifies far fewer of them."""
    fixed = check_drafter(checkpoints[arch], METHODS[arch])
    adaptive = check_drafter(checkpoints[arch], METHODS[arch], adaptive=True)
    assert adaptive.drafted < fixed.drafted / 2, (adaptive.drafted, fixed.drafted)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_a_verifier_accepting_every_draft_changes_the_tokens(arch, checkpoints, monkeypatch):
    """Mutation: the check's equality is what catches a broken verification."""
    from deepinfer.speculative import decoder

    real = decoder.verify

    def accept_all(items):
        return [item.draft + tokens[-1:] for item, tokens in zip(items, real(items), strict=True)]

    monkeypatch.setattr(decoder, "verify", accept_all)
    result = check_drafter(checkpoints[arch], METHODS[arch])
    assert result.drafted > 0
    assert result.tokens("spec") != result.tokens("plain")
