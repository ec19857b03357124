"""Rolling a sequence back to its accepted tokens after verification.

A drafted chunk writes cache rows for every drafted position; the rejected ones must not be
read later. Paged rows need nothing (they are rewritten before anything reads them); the
per-sequence compressor state sometimes does, which ``rollback_point`` decides and ``Rollback``
carries out with a copy of the slot saved before the step.
"""

from __future__ import annotations

from typing import Protocol

import torch


def rollback_point(
    start: int, chunk_end: int, accepted_end: int, ratios: list[int], overlap_ratios: list[int]
) -> int | None:
    """Where a drafted chunk ``[start, chunk_end)`` whose positions ``< accepted_end`` were
    accepted leaves the sequence's computed count, so the cache needs no copy restored.

    Paged rows (window K=V, entries, index keys, Engram history) of rejected positions are
    rewritten before anything reads them. A compressor's partial-group buffer holds row
    ``p % r`` of each position of the open group, so it stays right for accepted positions,
    except those of a group this chunk closed (closing consumes the rows without storing
    them): those few positions are recomputed. An overlap (V4's CSA: the last closed group)
    overwritten by a group holding rejected tokens cannot be rebuilt that way: None, restore
    the saved slot state and recompute from ``start``.
    """
    if any((chunk_end // r) * r > accepted_end for r in overlap_ratios):
        return None
    point = accepted_end
    for r in ratios:
        open_group = (accepted_end // r) * r
        if accepted_end > open_group and chunk_end // r > accepted_end // r:
            point = min(point, max(start, open_group))
    return point


class SlotState(Protocol):
    """Copies of a sequence slot's compressor state (the engine's model runner)."""

    def save_slot(self, slot: int) -> list[torch.Tensor]: ...

    def restore_slot(self, slot: int, saved: list[torch.Tensor]) -> None: ...


class RollbackSequence(Protocol):
    """What a rollback changes of a request."""

    request_id: str
    slot: int | None
    num_computed_tokens: int
    restore_overlap: bool


class RollbackChunk(Protocol):
    request: RollbackSequence
    start: int
    restore_overlap: bool
    draft: list[int]

    @property
    def end(self) -> int: ...


class Rollback:
    """Saves the slot state of drafted chunks that may need it and brings each verified
    chunk's sequence back to the positions whose cache state is valid."""

    def __init__(self, ratios: list[int], overlap_ratios: list[int], slots: SlotState) -> None:
        """``ratios``: the cache's compression ratios; ``overlap_ratios``: those whose
        compressor state includes the overlap (the last closed group), which only a saved copy
        can bring back."""
        self.ratios, self.overlap_ratios = ratios, overlap_ratios
        self.slots = slots
        self.saved: dict[str, list[torch.Tensor]] = {}

    @property
    def drafts_after_recompute(self) -> bool:
        """Whether a chunk that recomputes accepted tokens may carry drafts: only when a
        rejection never rolls back past the chunk's own accepted part (no overlap state)."""
        return not self.overlap_ratios

    def before_step(self, chunk: RollbackChunk) -> None:
        if chunk.draft and self.overlap_ratios:
            assert chunk.request.slot is not None
            self.saved[chunk.request.request_id] = self.slots.save_slot(chunk.request.slot)

    def apply(self, chunk: RollbackChunk, accepted_end: int) -> None:
        """Positions ``< accepted_end`` of the chunk's sequence are accepted (the last of them
        not computed yet): set its computed count, restoring the saved slot if needed."""
        req = chunk.request
        saved = self.saved.pop(req.request_id, None)
        point = rollback_point(chunk.start, chunk.end, accepted_end, self.ratios, self.overlap_ratios)
        if point is None:  # an overlap was overwritten by a group holding rejected tokens
            assert saved is not None and req.slot is not None
            self.slots.restore_slot(req.slot, saved)
            req.num_computed_tokens = chunk.start  # recompute the anchor and accepted tokens
            # (a chunk that restores a prefix snapshot is a first chunk and never drafts today;
            # if it did, the saved state would predate that restore)
            req.restore_overlap = chunk.restore_overlap
        else:
            req.num_computed_tokens = point

    def forget(self, request_id: str) -> None:
        self.saved.pop(request_id, None)
