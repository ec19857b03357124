"""N-gram prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` method): the
draft for a sequence is what followed an earlier occurrence of its last ``n`` tokens (the most
recent one with a full draft after it), the longest ``n`` from ``max_n`` down to ``min_n``. It
costs no model and wins when the output repeats its input (code edits, summaries quoting the
text, extraction).

The lookup runs for every decoding request after every step, paused ones included (their
drafts are scored as shadow trials), so its host time is paid even where nothing is verified.
It grows the match instead of testing each ``n``: the positions whose token equals the newest
one, then those whose previous token also matches, and so on; each round is one small array
operation. Each slot keeps its sequence as a growing array, so a step appends its new tokens
instead of copying the whole history. (A sliding-window view per ``n`` over a fresh copy
costs a visible share of a mixed batch's step, for every request.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.speculative.drafter import Draft, DraftRequest


@dataclass
class _History:
    """A slot's tokens so far, for the request whose output list it was built from."""

    output: Sequence[int]  # the request's own list (held, so its identity stays unique)
    tokens: np.ndarray  # capacity >= filled
    filled: int


class NgramDrafter:
    """A ``Drafter`` that reads only each sequence's tokens (no model, no features); its
    drafts are deterministic given the history, so verification treats ``q`` as one-hot."""

    window = 0
    cache_bytes = 0
    feature_layers: tuple[int, ...] = ()

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
        self._histories: dict[int, _History] = {}

    def claim(self, slot: int, request_id: str) -> None:
        pass  # a slot's history is checked against the request's own lists at each proposal

    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        pass  # reads no features

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(r.anchor_pos, self.lookup(self._history(r)), None, []) for r in requests]

    def _history(self, r: DraftRequest) -> np.ndarray:
        """The slot's sequence (prompt and output so far) as an array view, extended by the
        tokens since its last proposal; rebuilt when the output list is not the one it was
        built from (a new request in the slot, or new lists for this one). A request's lists
        only grow: the engine appends and never edits an emitted token, and a preempted
        request keeps its lists."""
        prompt, output = r.prompt_token_ids, r.output_token_ids
        length = len(prompt) + len(output)
        h = self._histories.get(r.slot)
        if h is None or h.output is not output:
            tokens = np.empty(max(2 * length, 64), dtype=np.int64)
            tokens[: len(prompt)] = prompt
            h = self._histories[r.slot] = _History(output, tokens, len(prompt))
        if length > h.tokens.shape[0]:
            grown = np.empty(2 * length, dtype=np.int64)
            grown[: h.filled] = h.tokens[: h.filled]
            h.tokens = grown
        if length > h.filled:
            h.tokens[h.filled : length] = output[h.filled - len(prompt) :]
            h.filled = length
        return h.tokens[:length]

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Up to ``num_draft_tokens`` drafted ids for the sequence ``tokens`` (prompt and
        output so far); empty when no earlier occurrence of a suffix of ``min_n`` or more
        tokens exists."""
        arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
        length = arr.shape[0]
        if length < 2:
            return []
        # ends[i]: the last position of an earlier occurrence of the newest n tokens
        ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
        n = 1
        while n < self.max_n and ends.size:
            longer = ends[ends >= n]
            longer = longer[arr[longer - n] == arr[length - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.min_n:
            return []
        # the most recent occurrence that still has a full draft after it (a periodic tail
        # matches just before the end, leaving one token), else the earliest
        k = self.num_draft_tokens
        full = ends[ends + 1 + k <= length]
        follow = int(full[-1] if full.size else ends[0]) + 1
        return arr[follow : follow + k].tolist()
