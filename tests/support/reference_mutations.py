"""Engine-side mutations for the reference checks: a loader that reads tensors under each
other's names, so a check whose reference reads the checkpoint itself must fail."""

from __future__ import annotations

import pytest

import deepinfer.weights.loader as loader


def swap_on_load(monkeypatch: pytest.MonkeyPatch, pairs: list[tuple[str, str]]) -> None:
    """Make the engine's loader fill each pair's tensors with each other's data (a naming
    bug; the pairs share a shape, so loading succeeds)."""
    swap = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    read = loader._read_weight
    monkeypatch.setattr(
        loader, "_read_weight", lambda reader, name, quant: read(reader, swap.get(name, name), quant)
    )
