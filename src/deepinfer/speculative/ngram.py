"""N-gram prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` method): the
draft for a sequence is what followed an earlier occurrence of its last ``n`` tokens (the most
recent one with a full draft after it), trying ``n`` from ``max_n`` down to ``min_n``. It costs
no model and wins when the output repeats its input (code edits, summaries quoting the text,
extraction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.speculative.drafter import Draft, DraftRequest


class NgramDrafter:
    """A ``Drafter`` that reads only each sequence's tokens (no model, no per-slot state);
    its drafts are deterministic given the history, so verification treats ``q`` as one-hot."""

    window = 0
    cache_bytes = 0

    def __init__(self, num_speculative_tokens: int = 5, min_n: int = 1, max_n: int = 4) -> None:
        for name, value in (
            ("num_speculative_tokens", num_speculative_tokens),
            ("min_n", min_n),
            ("max_n", max_n),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"min_n ({min_n}) must not exceed max_n ({max_n})")
        self.num_draft_tokens, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def claim(self, slot: int, request_id: str) -> None:
        pass  # no per-slot state

    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        pass  # reads no features

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(r.anchor_pos, self.lookup(r.tokens), None, []) for r in requests]

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Up to ``num_draft_tokens`` drafted ids for the sequence ``tokens`` (prompt and
        output so far); empty when no earlier occurrence of a suffix exists."""
        arr = np.asarray(tokens, dtype=np.int64)
        length = arr.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n :]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            if starts.size:
                # the most recent occurrence that still has a full draft after it (a periodic
                # tail matches just before the end, leaving one token), else the earliest
                k = self.num_draft_tokens
                full = starts[starts + n + k <= length]
                follow = int(full[-1] if full.size else starts[0]) + n
                return arr[follow : follow + k].tolist()
        return []
