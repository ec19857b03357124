"""Scheduler: one token budget per step shared by decodes and prefill chunks.

Running requests go first (a decode is one token; an unfinished prompt continues with a
chunk), then waiting requests in arrival order. When blocks run out, the most recently
admitted running request is preempted (its cache freed, recomputed later). The scheduler
knows requests, token counts and blocks; never tensors.

Its output is data: ``schedule(drafts)`` takes the step's draft tokens as a plain mapping
(the engine asks the speculative decoder before scheduling) and returns frozen
``ScheduledChunk``s that carry what the model runner reads of each request (its block
tables, slot and rank at scheduling time), so the runner never reads a live request's
tables.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from deepinfer.cache.prefix_hash import block_hash, prompt_block_hashes
from deepinfer.cache.tiers import KVTiers
from deepinfer.config import EngineConfig
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.request import Request, Status
from deepinfer.engine.tier_hits import TierHits

BATCH_INVARIANT_GRID = 32  # prefill chunk positions under batch_invariant (a block's divisor)


def grid_size(block_size: int) -> int:
    """The batch-invariant prefill grid: 32 positions, or fewer to divide the block size (a
    prefix-cache hit ends on a block boundary, which must be a grid boundary too)."""
    return math.gcd(block_size, BATCH_INVARIANT_GRID)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step. ``request`` is for processing the step's results; the
    runner reads the tables as they were when the chunk was scheduled (a step sent on to
    tensor-parallel ranks is built after the scheduler may have given blocks back)."""

    request: Request
    start: int  # first position computed
    num_tokens: int
    restore_overlap: bool
    samples: bool  # the chunk reaches the end of the known tokens: sample the next one
    draft: tuple[int, ...] = ()  # drafted tokens appended to the chunk
    block_ids: tuple[int, ...] = ()
    window_block_ids: tuple[int, ...] = ()
    slot: int = -1
    dp_rank: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def _take_chunk(
    request: Request, computed: int, num_new: int, known: int, draft: Sequence[int]
) -> ScheduledChunk:
    """The chunk of ``num_new`` positions from ``computed`` (the request's computed count) of a
    request with ``known`` tokens, counted as computed; a drafted chunk is rolled back to its
    accepted part after verification (``StepProcessor.process``). The caller passes the counts it
    read already: a decode step makes one chunk per running request."""
    chunk = ScheduledChunk(
        request,
        computed,
        num_new,
        request.restore_overlap,
        computed + num_new - len(draft) == known,
        tuple(draft),
        tuple(request.block_ids),
        tuple(request.window_block_ids),
        request.slot if request.slot is not None else -1,
        request.dp_rank,
    )
    request.restore_overlap = False
    request.num_computed_tokens = computed + num_new
    return chunk


class Scheduler:
    """Decides each step's chunks from requests, a token budget and free blocks, never
    tensors: running requests first (decodes, the rest of chunked prefills, drafts within the
    budget), preempting the newest when blocks run out, then waiting requests with their
    longest cached prefix. It owns block and slot allocation and the prefix cache's
    publishing; the engine reports finishes."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        block_size: int,
        num_slots: int,
        drafts_after_recompute: bool = False,
        window_pool: BlockPool | None = None,
        window: int = 0,
        tiers: KVTiers | None = None,
        block_published: Callable[[Request, int, bytes], None] | None = None,
    ) -> None:
        """``drafts_after_recompute``: a chunk that recomputes the last few accepted tokens after
        a rejection may carry drafts (when a rejection never rolls back past the chunk's own
        accepted part, ``speculative.rollback``; else recomputed chunks would keep growing).
        ``window_pool``: the blocks of a bounded window cache (``window`` tokens): a request
        holds those covering its last ``window - 1`` positions and the ones its next chunk
        writes, gives older ones back (kept, hashed, as evictable prefix-cache entries), and
        takes a prefix hit only where the window before the hit is still cached. ``tiers``:
        host and disk tiers below the pool, which every published block is copied to and a
        prefix hit continues into (``tier_hits``). ``block_published``: told of each block as
        it is published, as (request, block index, prefix hash)."""
        self.config = config
        self.drafts_after_recompute = drafts_after_recompute
        self.pool = pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.window_pool = window_pool
        self.window = window
        self.block_published = block_published
        self.tier_hits = None if tiers is None else TierHits(tiers, pool, window_pool, block_size, window)
        if tiers is not None:  # a block handed out drops the tier copy still queued for it
            pool.on_allocate = tiers.reallocated
            if window_pool is not None:
                window_pool.on_allocate = functools.partial(tiers.reallocated, window=True)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def ranks(self) -> list[Scheduler]:
        """The per-rank schedulers (this one alone), as ``DataParallelScheduler.ranks``."""
        return [self]

    def forget_computed(self) -> None:
        """Every running request computes again from its first token, tier loads under way
        are dropped and the pools' prefix caches forget every block: nothing computed so far
        is read again (the weights changed, or the cache's memory was given back)."""
        for request in list(self.running):
            self.preempt(request)
        if self.tier_hits is not None:
            self.tier_hits.drop_loads(self.waiting, self._release)
        for pool in (self.pool, self.window_pool):
            if pool is not None:
                pool.reset_prefix_cache()

    @property
    def num_unfinished(self) -> int:
        loading = self.tier_hits.num_loading if self.tier_hits is not None else 0
        return len(self.waiting) + len(self.running) + loading

    # ---- cache ownership ------------------------------------------------------------------

    def _ensure_blocks(self, request: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        if need > 0:
            blocks = self.pool.allocate(need)
            if blocks is None:
                return False
            request.block_ids.extend(blocks)
        return self._ensure_window(request, num_tokens)

    def _ensure_window(self, request: Request, num_tokens: int) -> bool:
        """Window blocks for the positions the next chunk writes (up to ``num_tokens``)."""
        if self.window_pool is None:
            return True
        ids = request.window_block_ids
        blocks = -(-num_tokens // self.block_size)
        first = request.num_computed_tokens // self.block_size
        if first == blocks - 1 and first < len(ids) and ids[first] >= 0:
            return True  # a decode inside a block it holds already
        ids.extend([-1] * (blocks - len(ids)))
        missing = [j for j in range(first, blocks) if ids[j] < 0]
        taken = self.window_pool.allocate(len(missing)) if missing else []
        if taken is None:
            return False
        for j, block in zip(missing, taken, strict=True):
            ids[j] = block
        return True

    def _give_back_window(self, request: Request, last: int) -> None:
        """Free ``request``'s window blocks from ``last`` back to the first one given back
        already, keeping their prefix-cache hashes (``after_step`` says when). The blocks given
        back so far are a prefix of the table (earlier calls gave back all before their limit;
        a prefix hit starts with one), so the walk goes back from the limit and stops at the
        first one given back: a step costs the blocks it frees, not the sequence's length. The
        blocks are freed in table order, as a forward walk would."""
        assert self.window_pool is not None
        ids, freed, j = request.window_block_ids, [], last
        while j >= 0 and ids[j] >= 0:
            freed.append(ids[j])
            ids[j] = -1
            j -= 1
        self.window_pool.free(freed[::-1])

    def _release(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.block_hashes = []
        if self.window_pool is not None:
            self.window_pool.free([b for b in request.window_block_ids if b >= 0])
        request.window_block_ids = []
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None

    def _give_back_loaded_hits(self) -> bool:
        """Free the blocks that waiting requests hold from tier loads that ended (published:
        their prefix stays cached), before a running request is preempted for blocks. A
        running request preempted before its step was processed publishes nothing of that
        step (asynchronous scheduling), so two requests that keep taking each other's blocks
        would otherwise start over forever. Whether any were freed."""
        if self.tier_hits is None:
            return False
        held = [r for r in self.waiting if r.block_ids and r.tier_load is None]
        for request in held:
            self._release(request)
            request.num_computed_tokens = 0
            request.restore_overlap = False
        return bool(held)

    def _prefix_hit(self, request: Request) -> None:
        """Take cached blocks for the longest cached prefix (always leaving >= 1 token)."""
        if not self.config.enable_prefix_caching or request.block_ids:
            return
        if request.params.prompt_logprobs is not None:  # needs logits of every prompt token
            return
        hashes = prompt_block_hashes(request.all_token_ids, self.block_size, request.prefix_salt)
        hit = self.pool.lookup(hashes)
        if (
            self.tier_hits is not None
            and len(hit) < len(hashes)
            and self.tier_hits.extend(request, hit, hashes)
        ):
            return
        hit = self._window_for_hit(request, hit, hashes)
        request.block_ids = hit
        request.block_hashes = hashes[: len(hit)]
        request.num_computed_tokens = len(hit) * self.block_size
        request.restore_overlap = bool(hit)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens

    def _window_for_hit(self, request: Request, hit: list[int], hashes: list[bytes]) -> list[int]:
        """With a bounded window, shorten a prefix hit to the longest one whose window (the
        ``window - 1`` positions before it) is still cached, and take those window blocks."""
        if self.window_pool is None:
            return hit
        bs = self.block_size
        while hit:
            end = len(hit) * bs
            first = max(0, end - self.window + 1) // bs
            window = self.window_pool.acquire(hashes[first : len(hit)])
            if window is not None:
                request.window_block_ids = [-1] * first + window
                return hit
            self.pool.free([hit.pop()])
            self.pool.hit_blocks -= 1
        return hit

    def publish_full_blocks(self, request: Request, computed: int | None = None) -> None:
        """After a step (or as a request finishes): publish newly completed blocks under their
        prefix hashes. ``computed`` bounds the positions whose rows are valid (default: the
        computed count)."""
        if not self.config.enable_prefix_caching or request.status is not Status.RUNNING:
            return
        bs, given = self.block_size, computed is not None
        computed = request.num_computed_tokens if computed is None else computed
        known = len(request.prompt_token_ids) + len(request.output_token_ids)
        full = min(computed, known) // bs
        if full <= len(request.block_hashes):
            return  # the common decode step: no block filled since the last call
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        for k in range(len(request.block_hashes), full):
            parent = block_hash(parent, tokens[k * bs : (k + 1) * bs], request.prefix_salt)
            request.block_hashes.append(parent)
            self.pool.cache(request.block_ids[k], parent)
            if self.block_published is not None:
                self.block_published(request, k, parent)
            window = request.window_block_ids
            window_block = window[k] if k < len(window) and window[k] >= 0 else None
            if self.window_pool is not None and window_block is not None:
                self.window_pool.cache(window_block, parent)
            if self.tier_hits is not None:  # ``computed`` given: its rows are written
                self.tier_hits.tiers.store(parent, request.block_ids[k], window_block, written=given)

    def after_step(self, requests: list[Request]) -> None:
        """After a step, for each of its running requests (only they moved): publish the blocks
        it filled, then give back the window blocks no later position reads (all before the
        next position's window). A block given back while a step that reads it is still to run
        is safe: only steps write blocks, one at a time, so a new owner writes it only later.
        A decode step does either about once a block per request, so both are tested here
        first (``publish_full_blocks``' own first test, inline) and called only then, which
        trims the host's time per request step (benchmarks/RESULTS.md)."""
        bs, window = self.block_size, self.window
        publish = self.config.enable_prefix_caching
        trim = self.window_pool is not None
        running = Status.RUNNING
        for request in requests:
            if request.status is not running:
                continue
            computed = request.num_computed_tokens
            if publish and min(
                computed, len(request.prompt_token_ids) + len(request.output_token_ids)
            ) // bs > len(request.block_hashes):
                self.publish_full_blocks(request)
            if trim:
                ids = request.window_block_ids
                last = min(max(0, computed - window + 1) // bs, len(ids)) - 1  # before the window
                if last >= 0 and ids[last] >= 0:
                    self._give_back_window(request, last)

    # ---- the policy -----------------------------------------------------------------------

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.restore_overlap = False
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, computed: int | None = None) -> None:
        """``computed``: the rows written validly; their full blocks stay in the prefix cache
        (a request that ends with its prefill still shares its prompt). None publishes none."""
        if request.tier_load is not None:  # its blocks are being filled: released once they are
            request.status = Status.FINISHED
            return
        if computed is not None:
            self.publish_full_blocks(request, computed)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED

    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> list[ScheduledChunk]:
        """This step's chunks. ``drafts``: speculative tokens to verify after a decoding
        request's newest token, by request id; a request takes those that fit the budget
        left once its own token is counted."""
        if self.tier_hits is not None:
            self.tier_hits.poll(self.waiting, self._release)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        i = 0
        batch_invariant = self.config.batch_invariant
        bs, windowed = self.block_size, self.window_pool is not None
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            computed = request.num_computed_tokens
            known = len(request.prompt_token_ids) + len(request.output_token_ids) + request.pending_tokens
            todo = known - computed  # ``request.num_tokens`` inline (one read per request)
            if todo <= 0:  # waiting for an in-flight token
                i += 1
                continue
            num_new = min(todo, budget)
            if batch_invariant:
                num_new = self._grid_chunk(request, todo, budget)
                if num_new == 0:  # the next grid cell does not fit this step's budget
                    i += 1
                    continue
            draft: Sequence[int] = ()
            if drafts and num_new == todo and self.may_draft(request):
                # drafts follow the newest token
                draft = drafts.get(request.request_id, ())[: budget - num_new]
            num_new += len(draft)
            end = computed + num_new
            # a chunk inside the blocks (and the window block) it holds needs no allocation:
            # ``_ensure_blocks``' own first checks, without its two calls (most decode steps)
            first, ids = computed // bs, request.window_block_ids
            ready = len(request.block_ids) * bs >= end and (
                not windowed or (first == (end - 1) // bs and first < len(ids) and ids[first] >= 0)
            )
            ready = ready or self._ensure_blocks(request, end)
            if not ready and self._give_back_loaded_hits():
                ready = self._ensure_blocks(request, end)
            while not ready:
                victim = next((r for r in reversed(self.running) if id(r) not in scheduled), None)
                if victim is None:
                    break
                self.preempt(victim)
                if victim is request:
                    break
                ready = self._ensure_blocks(request, request.num_computed_tokens + num_new)
            # blocks that ``_ensure_blocks`` provided cover the chunk; otherwise check
            if request.status is not Status.RUNNING or (not ready and not self._has_blocks(request, num_new)):
                break
            chunks.append(_take_chunk(request, computed, num_new, known, draft))
            scheduled.add(id(request))
            budget -= num_new
            i += 1

        while (
            self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and self.free_slots
        ):
            request = self.waiting[0]
            if request.lora is not None and not self._adapter_fits(request):
                break  # max_loras adapters run already: it waits for one of them to end
            self._prefix_hit(request)
            if request.tier_load is not None:  # waits for its blocks, holding them
                self.waiting.popleft()
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.config.batch_invariant:
                num_new = self._grid_chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0 or not self._ensure_blocks(request, request.num_computed_tokens + num_new):
                # give back the prefix hit, and the loaded ones of requests behind it (a tier
                # hit waits holding blocks, which the first in line may need); retry next step
                for held in [request] if self.tier_hits is None else self.waiting:
                    if held.block_ids or held.window_block_ids:
                        self._release(held)
                        held.num_computed_tokens = 0
                        held.restore_overlap = False
                break
            self.waiting.popleft()
            request.slot = self.free_slots.pop()
            request.status = Status.RUNNING
            self.running.append(request)
            chunks.append(_take_chunk(request, request.num_computed_tokens, num_new, request.num_tokens, ()))
            budget -= num_new
        if not chunks and self.tier_hits is not None:
            self.tier_hits.wait()  # nothing runs until a load ends: wait for it, not spin
        return chunks

    def _adapter_fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter may run beside the running requests' adapters (at
        most ``max_loras`` distinct ones run at once: each step's adapters hold a slot)."""
        running = {id(r.lora) for r in self.running if r.lora is not None}
        return id(request.lora) in running or len(running) < self.config.max_loras

    def _grid_chunk(self, request: Request, todo: int, budget: int) -> int:
        """``batch_invariant``: the next chunk is the rest of the current grid cell (of
        ``grid_size(block_size)`` positions; or of the known tokens, if fewer), whatever the
        budget, so a sequence is always cut at the same places; 0 when that does not fit
        this step's remaining budget."""
        start = request.num_computed_tokens
        grid = grid_size(self.block_size)
        cell_end = (start // grid + 1) * grid
        num_new = min(todo, cell_end - start)
        return num_new if num_new <= budget else 0

    def may_draft(self, request: Request) -> bool:
        """Decoding, with every known token's value known; one token left to compute, or a
        few accepted ones to recompute when ``drafts_after_recompute``."""
        todo = request.num_tokens - request.num_computed_tokens
        return (
            bool(request.output_token_ids)
            and request.pending_tokens == 0
            and (todo == 1 or (todo > 1 and self.drafts_after_recompute))
        )

    def _has_blocks(self, request: Request, num_new: int) -> bool:
        return len(request.block_ids) * self.block_size >= request.num_computed_tokens + num_new
