"""Data-parallel attention: one scheduler per rank, behind the one-scheduler interface.

Each data-parallel rank keeps the KV cache of its own requests, so each has its own block
pool, window pool, sequence slots and prefix cache, and its own token budget and
``max_num_seqs`` per step (as vLLM's per-rank engine cores do). A request is placed once, on
the rank with the fewest unfinished requests, and stays there (its cache lives there). A
step is every rank's chunks, rank 0's first: the engine runs each rank's part on that rank
and joins the logits in this order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler


class DataParallelScheduler:
    """The engine's scheduler when ``data_parallel_size`` > 1: ``ranks[r]`` schedules the
    requests whose ``dp_rank`` is r."""

    def __init__(self, ranks: list[Scheduler]) -> None:
        self.ranks = ranks

    def add(self, request: Request) -> None:
        """Place the request on the least loaded rank (ties: the lowest rank)."""
        rank = min(range(len(self.ranks)), key=lambda r: (self.ranks[r].num_unfinished, r))
        request.dp_rank = rank
        self.ranks[rank].add(request)

    @property
    def num_unfinished(self) -> int:
        return sum(s.num_unfinished for s in self.ranks)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> list[ScheduledChunk]:
        """Every rank's chunks for this step, grouped by rank in rank order (``drafts``: as
        ``Scheduler.schedule`` takes them, for every rank's requests)."""
        return [c for s in self.ranks for c in s.schedule(drafts)]

    def forget_computed(self) -> None:
        """Every rank's ``Scheduler.forget_computed``."""
        for s in self.ranks:
            s.forget_computed()

    def _of(self, request: Request) -> Scheduler:
        return self.ranks[request.dp_rank]

    def after_step(self, requests: list[Request]) -> None:
        for request in requests:
            self._of(request).after_step([request])

    def finish(self, request: Request, computed: int | None = None) -> None:
        self._of(request).finish(request, computed)

    def may_draft(self, request: Request) -> bool:
        return self._of(request).may_draft(request)
