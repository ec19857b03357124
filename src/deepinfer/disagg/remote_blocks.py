"""A decode server's remote source of blocks (``KVTiers.remote``): what prefill servers offered
after prefilling a prompt, fetched when the scheduler's prefix hit reaches them.

The scheduler asks ``has`` for each of a new request's block hashes, takes fresh blocks for
those offered, and the tiers' loader thread calls ``fetch``; a block that does not come
(the peer died, stalled past the timeout, evicted it, or the rows failed their checksum)
fails the load, and the scheduler computes the prompt itself, as after any failed tier load.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepinfer.disagg.transfer import BlockReceiver

logger = logging.getLogger("deepinfer")

Endpoint = tuple[str, int]


@dataclass
class TransferStats:
    """Counters since the server started."""

    fetches: int = 0
    blocks: int = 0
    failed: int = 0  # fetches whose peer was gone or stalled
    corrupt: int = 0  # fetches whose rows failed the checksum
    offers_refused: int = 0  # offers from an untrusted host, or of another model or format


class RemoteBlocks:
    """Offered block hashes by prefill endpoint (at most ``capacity``, oldest dropped) and one
    connection per endpoint, made on first fetch."""

    def __init__(
        self,
        entry_bytes: int,
        namespace: str,
        timeout_s: float,
        trusted_hosts: frozenset[str] = frozenset({"127.0.0.1", "localhost"}),
        capacity: int = 1 << 16,
    ) -> None:
        """``trusted_hosts``: the prefill servers whose offers are taken. An offered block
        enters the prefix cache every request shares, so an offer naming another host, which
        a client could send with its request, could plant rows under another prompt's hash."""
        self.entry_bytes, self.namespace, self.timeout_s = entry_bytes, namespace, timeout_s
        self.trusted_hosts = trusted_hosts
        self.capacity = capacity
        self._offered: OrderedDict[bytes, Endpoint] = OrderedDict()
        self._receivers: dict[Endpoint, BlockReceiver] = {}
        self._lock = threading.Lock()
        self.stats = TransferStats()

    def offer(self, keys: list[bytes], host: str, port: int, namespace: str) -> bool:
        """A prefill server holds ``keys``; False (nothing kept) when its blocks are of another
        model, cache layout or element type than this server's (``namespace``)."""
        if host not in self.trusted_hosts:
            with self._lock:
                self.stats.offers_refused += 1
            logger.warning("KV transfer: an offer from %s, not a trusted prefill host, was refused", host)
            return False
        if namespace != self.namespace:
            with self._lock:
                self.stats.offers_refused += 1
            logger.warning("KV transfer: %s:%d serves blocks of another model or cache format", host, port)
            return False
        with self._lock:
            for key in keys:
                self._offered[key] = (host, port)
                self._offered.move_to_end(key)
            while len(self._offered) > self.capacity:
                self._offered.popitem(last=False)
        return True

    def has(self, key: bytes) -> bool:
        return key in self._offered

    def fetch(self, keys: list[bytes]) -> list[torch.Tensor | None]:
        """Rows of ``keys`` from the peers that offered them (None where one did not come);
        the keys are no longer offered afterwards (the blocks now live in this server)."""
        with self._lock:
            where = [self._offered.pop(k, None) for k in keys]
        out: list[torch.Tensor | None] = [None] * len(keys)
        for endpoint in dict.fromkeys(e for e in where if e is not None):
            mine = [i for i, e in enumerate(where) if e == endpoint]
            rows = self._fetch_from(endpoint, [keys[i] for i in mine])
            for i, row in zip(mine, rows, strict=True):
                out[i] = row
        return out

    def _fetch_from(self, endpoint: Endpoint, keys: list[bytes]) -> list[torch.Tensor | None]:
        self.stats.fetches += 1
        try:
            receiver = self._receivers.get(endpoint)
            if receiver is None:
                receiver = self._receivers[endpoint] = self._connect(endpoint)
            rows, intact = receiver.fetch(keys)
        except Exception as exc:  # the peer died or stalled: this server computes the prompt
            self._receivers.pop(endpoint, None)
            self.stats.failed += 1
            logger.warning("KV transfer from %s:%d failed (%s); the prompt is computed here", *endpoint, exc)
            return [None] * len(keys)
        if not intact:
            self.stats.corrupt += 1
            logger.warning(
                "KV transfer from %s:%d failed its checksum; the prompt is computed here", *endpoint
            )
            return [None] * len(keys)
        self.stats.blocks += sum(r is not None for r in rows)
        return rows

    def _connect(self, endpoint: Endpoint) -> BlockReceiver:
        """A connection to ``endpoint`` within the timeout. The store's client waits past its
        own timeout on a peer that accepts and never answers (a stopped process), so it is
        made on a thread of its own, abandoned when late."""
        made: list[BlockReceiver | BaseException] = []

        def connect() -> None:
            try:
                made.append(BlockReceiver(*endpoint, self.entry_bytes, self.timeout_s))
            except BaseException as exc:
                made.append(exc)

        thread = threading.Thread(target=connect, name="deepinfer-kv-connect", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not made:
            raise TimeoutError(f"no answer within {self.timeout_s} s")
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def close(self) -> None:
        for receiver in self._receivers.values():
            receiver.close()
        self._receivers.clear()
