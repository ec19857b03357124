"""A stand-in for the model's choices: a host function ``(logits, rows, **options) ->
list[int]`` installed as the step processor's sampler on both of its paths, the host one
(``sample``: rows under a grammar or a logits processor) and the device one (``sample_tokens``,
which ``DeviceSampling`` calls for plain rows right after the forward)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import deepinfer.engine.step_processor as step_processor

Pick = Callable[..., list[int]]


@contextmanager
def scripted_sampler(pick: Pick) -> Iterator[None]:
    real = step_processor.sample, step_processor.sample_tokens

    def on_device(logits: torch.Tensor, rows, positions: list[int], rowwise: bool = False) -> torch.Tensor:
        tokens = pick(logits, rows, rowwise=rowwise, positions=positions)
        return torch.tensor(tokens, dtype=torch.long, device=logits.device)

    step_processor.sample, step_processor.sample_tokens = pick, on_device
    try:
        yield
    finally:
        step_processor.sample, step_processor.sample_tokens = real
