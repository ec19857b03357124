"""Deliberately broken variants: those the statistical tests must catch (their mutation
checks), and drafts wrong from a chosen depth."""

from __future__ import annotations

import torch


def accept_every_draft(monkeypatch) -> None:
    """Speculative verification that accepts every drafted token, whatever the target says."""
    from deepinfer.speculative import verify

    original = verify.acceptance_and_recovery

    def accept_all(*args):
        accepted, recovered = original(*args)
        return torch.ones_like(accepted), recovered

    monkeypatch.setattr(verify, "acceptance_and_recovery", accept_all)


def wrong_from(tokens: list[int], depth: int) -> list[int]:
    """``tokens`` with every token from ``depth`` on replaced by a different one: a draft
    right up to ``depth`` and wrong after it."""
    return tokens[:depth] + [(t + 1) % 250 + 3 for t in tokens[depth:]]
