"""Deliberately broken variants the statistical tests must catch (their mutation checks)."""

from __future__ import annotations

import torch


def accept_every_draft(monkeypatch) -> None:
    """Speculative verification that accepts every drafted token, whatever the target says."""
    from deepinfer.engine import spec_decode

    original = spec_decode.acceptance_and_recovery

    def accept_all(*args):
        accepted, recovered = original(*args)
        return torch.ones_like(accepted), recovered

    monkeypatch.setattr(spec_decode, "acceptance_and_recovery", accept_all)
