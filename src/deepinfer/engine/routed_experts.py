"""``enable_return_routed_experts``: which experts every token a request's model read was
routed to, per MoE layer, for a trainer's routing replay (R3; vLLM's and SGLang's option).

Each step's MoE layers record their choices on the step's ``RoutingTrace``
(``cache/forward_batch.py``); after the step the rows go to their requests by position. A
request that took cached prefix blocks never computed those positions: when the scheduler
publishes a block, the rows that computed it are kept under its prefix hash, and a hit reads
them back, so every reported row is the routing the cached K/V was made with. Weight updates
forget those rows with the prefix cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from deepinfer.cache.forward_batch import RoutingTrace
from deepinfer.engine.request import Request

_UNKNOWN = -1


class RoutedExpertsRecorder:
    """Routing rows by request position, and by prefix-block hash for cache hits."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks  # as many block rows kept as the cache has blocks
        self.by_hash: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        # steps record on the asynchronous worker while the scheduler publishes blocks
        self._lock = threading.Lock()

    def record(
        self,
        requests: list[Request],
        starts: list[int],
        counts: list[int],
        trace: RoutingTrace,
        padded: bool = False,
    ) -> None:
        """A step's choices: ``counts[i]`` rows from position ``starts[i]`` of ``requests[i]``,
        in step order; ``padded``: null rows follow them (a compiled step's padding)."""
        if not trace.recorded:
            return
        rows = trace.stacked().to(device="cpu", dtype=torch.int16)
        if padded and rows.shape[0] > sum(counts):
            rows = rows[: sum(counts)]
        if sum(counts) != rows.shape[0]:
            raise RuntimeError(
                f"routed experts: the step recorded {rows.shape[0]} rows for {sum(counts)} tokens"
            )
        first = 0
        with self._lock:
            for req, start, count in zip(requests, starts, counts, strict=True):
                self._write(req, start, rows[first : first + count])
                first += count

    def _write(self, req: Request, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        have = req.routed_experts
        if have is None or have.shape[0] < end:
            size = max(end, len(req.prompt_token_ids) + req.params.max_tokens)
            grown = torch.full((size, *rows.shape[1:]), _UNKNOWN, dtype=torch.int16)
            known = torch.zeros(size, dtype=torch.bool)
            if have is not None and req.routed_known is not None:
                grown[: have.shape[0]] = have
                known[: have.shape[0]] = req.routed_known
            req.routed_experts, req.routed_known = grown, known
        assert req.routed_experts is not None and req.routed_known is not None
        bs = self.block_size
        for k, h in enumerate(req.block_hashes[: start // bs]):  # a prefix-cache hit's blocks
            if h in self.by_hash and not bool(req.routed_known[k * bs : (k + 1) * bs].all()):
                req.routed_experts[k * bs : (k + 1) * bs] = self.by_hash[h]
                req.routed_known[k * bs : (k + 1) * bs] = True
        req.routed_experts[start:end] = rows
        req.routed_known[start:end] = True
        # blocks published before these rows came (asynchronous scheduling publishes a block
        # while the step writing its last row runs) are kept now
        hashes = req.block_hashes
        for k in range(start // bs, min(-(-end // bs), len(hashes))):
            self._keep(req, k, hashes[k])

    def published(self, req: Request, block: int, h: bytes) -> None:
        """The scheduler published ``req``'s block ``block`` under ``h``: keep its rows (once
        they are all recorded)."""
        with self._lock:
            self._keep(req, block, h)

    def _keep(self, req: Request, block: int, h: bytes) -> None:
        bs, known = self.block_size, req.routed_known
        if known is None or req.routed_experts is None or h in self.by_hash:
            return
        if known.shape[0] >= (block + 1) * bs and bool(known[block * bs : (block + 1) * bs].all()):
            self.by_hash[h] = req.routed_experts[block * bs : (block + 1) * bs].clone()
            if len(self.by_hash) > self.max_blocks:
                self.by_hash.popitem(last=False)

    def rows_of(self, req: Request) -> torch.Tensor | None:
        """[tokens read, MoE layers, k] int32 for the request's prompt and completion tokens
        the model read (all but the newest); -1 only where no routing is known (a hit on a
        block whose rows were no longer kept)."""
        with self._lock:
            if req.routed_experts is None:
                return None
            n = len(req.prompt_token_ids) + len(req.output_token_ids) - 1
            return req.routed_experts[:n].to(torch.int32)

    def forget(self) -> None:
        """The weights changed: no kept block routing describes the cache any more."""
        with self._lock:
            self.by_hash.clear()
