"""A step as the scheduler hands it to the metadata builder: its chunks (``SeqChunk``, which
positions of which sequences run and where their blocks are) and how it is padded
(``StepPadding``, so compiled steps and captured graphs see shapes that do not follow the
step's contents).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPadding:
    """How a step is padded so its tensor shapes do not follow the batch's contents.

    Padded rows read and write only the *null* block and slot, which ``allocate_pools``
    reserves past the usable ones and no sequence ever owns; their outputs are discarded.

    - ``num_tokens``: pad the step with one-token null chunks up to this many tokens (a CUDA
      graph bucket); None keeps the step's own token count, but at least ``MIN_ROWS``.
    - ``max_model_len``: set for graph capture: every metadata tensor then takes the largest
      size a step of ``num_tokens`` decode tokens can need, so one shape serves the bucket.
      Without it each metadata tensor is padded to at least ``MIN_ROWS`` rows, so sizes 0 and
      1 (which ``torch.compile`` specialises) never reach the compiled step.
    """

    null_block: int
    null_slot: int
    num_tokens: int | None = None
    max_model_len: int | None = None
    null_window_block: int | None = None  # the window pool's null block (a bounded window)

    @classmethod
    def for_pools(cls, num_blocks: int, num_slots: int, **kw) -> StepPadding:
        return cls(null_block=num_blocks, null_slot=num_slots, **kw)


MIN_ROWS = 2


def padded_len(n: int, fixed: int | None) -> int:
    if fixed is not None:
        if n > fixed:
            raise ValueError(f"step needs {n} rows, more than the padded size {fixed}")
        return fixed
    return max(n, MIN_ROWS)


@dataclass
class SeqChunk:
    """One sequence's part of a step: which positions run, where its cache lives."""

    block_table: list[int]
    slot: int
    start: int  # first position computed this step (tokens before it are cached)
    num_tokens: int
    restore_overlap: bool = False  # start follows a prefix-cache hit: restore the snapshot
    logits_offsets: list[int] = field(default_factory=list)  # chunk offsets needing logits
    replay_from: int = 0  # CED prefill: positions before this run the encoder layers only
    feature_offsets: list[int] | None = None  # chunk offsets whose draft features are returned
    # window-pool block of each of ``block_table``'s blocks, as the request holds them (a
    # bounded window): entries < 0 (given back, or not taken) and blocks past the table's end
    # read ``window_null``, the window pool's null block; None: the window sits in block_table
    window_table: list[int] | None = None
    window_null: int | None = None


# chunk fields read for every chunk of a step, as C-level getters (``map`` over a step's
# chunks without a Python frame per chunk)
_NUM_TOKENS = operator.attrgetter("num_tokens")


def padded_chunks(chunks: list[SeqChunk], padding: StepPadding | None) -> list[SeqChunk]:
    """``chunks`` followed by one-token null chunks up to the padded token count."""
    if padding is None:
        return chunks
    real = sum(map(_NUM_TOKENS, chunks))
    target = padded_len(real, padding.num_tokens)
    null_window = padding.null_window_block
    null = SeqChunk(
        [padding.null_block],
        padding.null_slot,
        0,
        1,
        window_table=None if null_window is None else [null_window],
        window_null=null_window,
    )
    return chunks + [null] * (target - real)
