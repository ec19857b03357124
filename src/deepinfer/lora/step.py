"""The running step's adapter rows, for the layers that add a low-rank term.

The executor sets it around one forward; ``Projection``, the hooked linears and the routed
experts read it. Outside a step (research calls, the drafters) nothing is set and the base
weights alone compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraStep:
    """``mask`` [T, max_loras * max_rank]: row t is 1 over the rank columns of its request's
    adapter slot and 0 elsewhere (a base-model row is all 0)."""

    mask: torch.Tensor

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The mask for an input of ``x.shape[0]`` rows (the step's tokens)."""
        if x.shape[0] != self.mask.shape[0]:
            raise RuntimeError(
                f"a LoRA target ran on {x.shape[0]} rows in a step of {self.mask.shape[0]} tokens"
            )
        return self.mask


_current: ContextVar[LoraStep | None] = ContextVar("deepinfer_lora_step", default=None)


def current() -> LoraStep | None:
    """The running step's adapter rows (None: no adapter in the step, or no step)."""
    return _current.get()


@contextlib.contextmanager
def running(step: LoraStep | None) -> Iterator[None]:
    """Make ``step`` current for one forward."""
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)
