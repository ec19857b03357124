"""Prefix hits that continue past the device pool into the host and disk tiers
(``cache/tiers``): which blocks a hit takes from where, and the requests waiting for their
loads. The scheduler's part; blocks and hashes, no tensors."""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait

from deepinfer.cache.tiers import KVTiers
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.request import Request, Status


class TierHits:
    """A request whose prefix continues in a tier gets fresh blocks and waits here, holding
    them, until the loader filled them; the blocks are then published as a device-pool hit
    would have been, and the request goes back to the front of the waiting queue.

    A load starts at the scheduler's next call, not when its blocks are taken: under
    asynchronous scheduling the step in flight may still write rows of a request that ended
    after it was scheduled, into blocks freed since (the pool's rule is that a new owner
    writes only in a later step). By the next call that step has ended."""

    def __init__(
        self, tiers: KVTiers, pool: BlockPool, window_pool: BlockPool | None, block_size: int, window: int
    ) -> None:
        self.tiers = tiers
        self.pool = pool
        self.window_pool = window_pool
        self.block_size = block_size
        self.window = window
        self.loading: list[Request] = []
        self._unstarted: list[Request] = []  # loads planned by the last call, to start

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self.loading if r.status is not Status.FINISHED)

    def _first_window_block(self, blocks: int) -> int:
        """The first block whose window rows a hit of ``blocks`` blocks reads."""
        return max(0, blocks * self.block_size - self.window + 1) // self.block_size

    def _windows_held(self, end: int, pooled: int, hashes: list[bytes]) -> bool:
        """Whether a hit of ``end`` blocks finds every window block it reads: the loaded ones
        bring theirs; a device-pool block's is in the window pool or a tier."""
        wpool = self.window_pool
        if wpool is None:
            return True
        first = self._first_window_block(end)
        return all(
            wpool.cached(hashes[k]) or self.tiers.has(hashes[k]) for k in range(first, min(pooled, end))
        )

    def extend(self, request: Request, hit: list[int], hashes: list[bytes]) -> bool:
        """Continue the device pool's ``hit`` (blocks held) into the tiers: take blocks, start
        their load, set the request's cache state to the whole hit. False (nothing taken
        beyond ``hit``) when the tiers add nothing or blocks are short."""
        if request.tier_failed:
            return False
        pooled = end = len(hit)
        while end < len(hashes) and self.tiers.has(hashes[end]):
            end += 1
        while end > pooled and not self._windows_held(end, pooled, hashes):
            end -= 1
        if end == pooled:
            return False
        new = self.pool.allocate(end - pooled)
        if new is None:
            return False
        items: list[tuple[bytes, int | None, int | None]] = []
        window_ids: list[int] = []
        if self.window_pool is not None:
            first = self._first_window_block(end)
            window_ids = [-1] * first
            for k in range(first, end):
                held = self.window_pool.acquire([hashes[k]]) if k < pooled else None
                block = held or self.window_pool.allocate(1)
                if block is None:
                    self.pool.free(new)
                    self.window_pool.free([b for b in window_ids if b >= 0])
                    return False
                window_ids.append(block[0])
                if k < pooled and held is None:
                    items.append((hashes[k], None, block[0]))  # the window part alone
        for k in range(pooled, end):
            window_block = window_ids[k] if k < len(window_ids) and window_ids[k] >= 0 else None
            items.append((hashes[k], new[k - pooled], window_block))
        request.block_ids = hit + new
        request.window_block_ids = window_ids
        request.block_hashes = hashes[:end]
        request.num_computed_tokens = end * self.block_size
        request.restore_overlap = True
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
        request.tier_items = items
        request.tier_load = Future()  # started by the next ``poll``
        self.loading.append(request)
        self._unstarted.append(request)
        return True

    def poll(self, waiting: deque[Request], release) -> None:
        """Requests whose loads ended: publish their blocks and put them back at the front of
        ``waiting``; a failed load gives its blocks back (``release``) and the request looks
        its prefix up again, without the tiers. Then starts the loads planned since the last
        call."""
        for request in [r for r in self.loading if r.tier_load is not None and r.tier_load.done()]:
            self.loading.remove(request)
            load, items = request.tier_load, request.tier_items
            request.tier_load, request.tier_items = None, []
            assert load is not None
            ok = load.exception() is None and load.result()
            if request.status is Status.FINISHED:  # ended while loading
                release(request)
                continue
            if ok:
                for h, block, window_block in items:
                    if block is not None:
                        self.pool.cache(block, h)
                    if window_block is not None and self.window_pool is not None:
                        self.window_pool.cache(window_block, h)
            else:
                release(request)
                request.num_computed_tokens = request.num_cached_tokens = 0
                request.restore_overlap = False
                request.tier_failed = True
            waiting.appendleft(request)
        for request in self._unstarted:
            if request.status is Status.FINISHED:  # ended before its load began
                self.loading.remove(request)
                request.tier_load, request.tier_items = None, []
                release(request)
            else:
                request.tier_load = self.tiers.load(request.tier_items)
        self._unstarted.clear()

    def drop_loads(self, waiting: deque[Request], release) -> None:
        """Give back every loading request's blocks unpublished (the weights changed: what they
        were filled with is stale); the requests wait to start over."""
        for request in list(self.loading):
            if request.tier_load is not None and request not in self._unstarted:
                request.tier_load.exception()  # its blocks are written no more
            self.loading.remove(request)
            request.tier_load, request.tier_items = None, []
            release(request)
            if request.status is not Status.FINISHED:
                request.num_computed_tokens = request.num_cached_tokens = 0
                request.restore_overlap = False
                waiting.appendleft(request)
        self._unstarted.clear()

    def wait(self, timeout_s: float = 0.05) -> None:
        """Block until a load ends (or ``timeout_s``): a step with nothing else to run."""
        futures = [r.tier_load for r in self.loading if r.tier_load is not None and r not in self._unstarted]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
