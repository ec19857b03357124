"""Prompts that repeat a motif of 2 to 5 tokens: n-gram and model drafters find drafts in them
from the start (the speculative engine tests and the GPU drafter check)."""

from __future__ import annotations

import random


def repeating_prompts(
    n: int, seed: int = 0, repeats: int = 12, lengths: tuple[int, int] = (8, 60)
) -> list[list[int]]:
    """``n`` prompts, each a random motif repeated ``repeats`` times, cut to a random length in
    ``lengths`` (from, to exclusive)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 6))]
        prompts.append((motif * repeats)[: rng.randrange(*lengths)])
    return prompts
