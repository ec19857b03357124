"""Host and disk tiers under the device pool, keyed by the prefix cache's block hashes.

Every full block the prefix cache publishes is copied to the host tier as it is published
(write-through; a later eviction from the pool then costs nothing) and, on a writer thread,
to the disk tier. A request whose prefix continues past the pool's hit into the tiers gets
fresh blocks, which a loader thread fills while other requests' steps run; the scheduler
publishes them once the load is done (``Scheduler``). A load that meets a missing or corrupt
entry reports failure and the scheduler looks the prefix up again, without it."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from deepinfer.cache.tiers.codec import BlockCodec
from deepinfer.cache.tiers.disk import DiskTier
from deepinfer.cache.tiers.host import HostTier

logger = logging.getLogger("deepinfer")

_MAX_WRITE_BACKLOG = 256 << 20  # bytes queued for the disk writer; past it new blocks skip disk


@dataclass
class TierStats:
    """Counters since the engine started; ``hit_blocks`` / ``loaded_bytes`` by tier."""

    hit_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    loaded_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    stored_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    loads: int = 0
    failed_loads: int = 0
    load_seconds: float = 0.0
    disk_writes_dropped: int = 0
    corrupt_files: int = 0
    disk_write_errors: int = 0
    disk_full: bool = False
    host_used_bytes: int = 0
    host_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_capacity_bytes: int = 0


class RemoteSource(Protocol):
    """Blocks another server holds (a prefill server's, for a decode server): which it
    offers, and their rows (``BlockCodec`` rows; None where one did not come, or came
    damaged)."""

    def has(self, key: bytes) -> bool: ...

    def fetch(self, keys: list[bytes]) -> list[torch.Tensor | None]: ...


class KVTiers:
    """The tiers of one pool set. The scheduler speaks to it in block ids and hashes only.
    ``remote``: a further source after host and disk (``deepinfer.disagg``), set by whoever
    connects it."""

    def __init__(
        self,
        codec: BlockCodec,
        host_bytes: int,
        disk_dir: str | Path | None,
        disk_bytes: int,
        namespace: str,
    ) -> None:
        self.codec = codec
        self.host = (
            HostTier(host_bytes, codec.entry_bytes, codec.device.type == "cuda") if host_bytes else None
        )
        self.disk = DiskTier(Path(disk_dir), namespace, disk_bytes) if disk_dir is not None else None
        self._namespace = namespace
        self.remote: RemoteSource | None = None
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._pending: list[tuple[bytes, int, int | None]] = []  # published since the last flush
        self._held: list[tuple[bytes, int, int | None]] = []  # ... and before it, not copied yet
        self._backlog = 0
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-write")

    @property
    def namespace(self) -> str:
        """What the kept blocks are bound to (``fingerprint.namespace``): the weights, the
        cache layout and its element type."""
        return self._namespace

    # ---- the scheduler's side -------------------------------------------------------------

    def has(self, key: bytes) -> bool:
        """Whether a tier holds the block (a load may still find it gone or corrupt)."""
        return (
            (self.host is not None and self.host.has(key))
            or (self.disk is not None and self.disk.has(key))
            or (self.remote is not None and self.remote.has(key))
        )

    def store(self, key: bytes, block: int, window_block: int | None, written: bool = False) -> None:
        """Keep a just-published block (``window_block``: its window-pool block, when the
        window is bounded). ``written``: every row is written already, copy it now; else it is
        queued for ``flush`` (a step scheduled already may still write its last rows)."""
        if self.host is None and self.disk is None:
            return  # a remote source only (a decode server's): nothing here keeps blocks
        if self.codec.window and window_block is None:
            return  # a hit needs the window part; a block without it is not kept
        if self.host is not None and self.host.touch(key):
            return
        if self.host is None and self.disk is not None and self.disk.has(key):
            return
        if written:
            self.copy_blocks([(key, block, window_block)])
        else:
            self._pending.append((key, block, window_block))

    def reallocated(self, blocks: list[int], window: bool = False) -> None:
        """Pool blocks (``window``: window-pool blocks) were handed to a new owner: a copy still
        queued for one of them is dropped, since the new owner's step may write it before the
        copy runs (a preempted or finished request's freshly published block, taken at once
        from a full pool); the tier then misses that block instead of keeping wrong rows."""
        if not (self._pending or self._held):
            return
        taken, at = set(blocks), 2 if window else 1
        self._pending = [item for item in self._pending if item[at] not in taken]
        self._held = [item for item in self._held if item[at] not in taken]

    def flush(self, complete: bool = True) -> None:
        """Copy queued blocks out of the pools (into the host tier now, to disk on the writer
        thread), while no step runs. ``complete``: no step is scheduled and not yet run, so
        every queued block is written; else only those queued before the last flush are
        (the step scheduled since may write rows of the newer ones), and the newer ones wait
        for the next flush. Either way no step has reused the copied blocks yet: a freed block
        gets a new owner only in a step scheduled after it was freed."""
        ready = self._held + self._pending if complete else self._held
        self._held, self._pending = ([] if complete else self._pending), []
        if ready:
            self.copy_blocks(ready)

    def copy_blocks(self, items: list[tuple[bytes, int, int | None]]) -> None:
        """Copy (hash, block, window block) out of the pools now: into the host tier, and to
        disk on the writer thread. Called where no step writes those blocks."""
        rows = self.codec.gather([b for _, b, _ in items], [w for _, _, w in items])
        keys = [k for k, _, _ in items]
        if self.host is not None:
            # tail blocks first, so each chain's head is the most recently used: a tier evicts
            # a chain from its end, and a chain without its head is of no use
            for key, row in zip(reversed(keys), reversed(rows), strict=True):
                self.host.put(key, row)
            with self._lock:
                self._stats.stored_bytes["host"] += rows.numel()
        if self.disk is None:
            return
        with self._lock:
            if self._backlog + rows.numel() > _MAX_WRITE_BACKLOG:
                self._stats.disk_writes_dropped += len(keys)
                return
            self._backlog += rows.numel()
        self._writer.submit(self._write, self.disk, keys, rows)

    def load(self, items: Sequence[tuple[bytes, int | None, int | None]]) -> Future:
        """Fill blocks from the tiers on the loader thread: for each (hash, block, window
        block), the main part into ``block`` and the window part into ``window block`` (None:
        not needed). The future's result is whether every entry was found and intact."""
        return self._loader.submit(self.load_blocks, list(items))

    # ---- the threads ------------------------------------------------------------------------

    def _write(self, disk: DiskTier, keys: list[bytes], rows: torch.Tensor) -> None:
        written = 0
        try:
            for key, row in zip(reversed(keys), reversed(rows), strict=True):  # heads last (``copy_blocks``)
                if disk.write(key, row.numpy().tobytes(), self.codec.main_bytes):
                    written += row.numel()
        except Exception:  # a tier never takes the engine down
            logger.exception("KV disk tier: a write failed")
        with self._lock:
            self._backlog -= rows.numel()
            self._stats.stored_bytes["disk"] += written

    def read_entry(self, key: bytes) -> tuple[torch.Tensor, str] | None:
        """A kept block's row and the tier it came from (host, else disk: then also put in
        the host tier), or None."""
        row = self.host.get(key) if self.host is not None else None
        if row is not None:
            return row, "host"
        if self.disk is None:
            return None
        payload = self.disk.read(key, self.codec.main_bytes)
        if payload is None or len(payload) != self.codec.entry_bytes:
            return None
        row = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if self.host is not None:
            self.host.put(key, row)
        return row, "disk"

    def load_blocks(self, items: list[tuple[bytes, int | None, int | None]]) -> bool:
        """Fill the blocks of ``items`` now (``load``'s work); whether every entry was found.
        Entries neither tier holds come from the remote source in one fetch."""
        start = time.perf_counter()
        found: dict[int, tuple[torch.Tensor, str]] = {}
        for i in reversed(range(len(items))):  # heads touched last (``copy_blocks``)
            entry = self.read_entry(items[i][0])
            if entry is not None:
                found[i] = entry
        missing = [i for i in range(len(items)) if i not in found]
        if missing and self.remote is not None:
            rows = self.remote.fetch([items[i][0] for i in missing])
            for i, row in zip(missing, rows, strict=True):
                if row is not None:
                    found[i] = (row, "remote")
        if len(found) < len(items):
            with self._lock:
                self._stats.failed_loads += 1
            return False
        rows = [found[i][0] for i in range(len(items))]
        self.codec.scatter(torch.stack(rows), [b for _, b, _ in items], [w for _, _, w in items])
        if self.codec.device.type == "cuda":
            torch.cuda.current_stream(self.codec.device).synchronize()
        with self._lock:
            self._stats.loads += 1
            self._stats.load_seconds += time.perf_counter() - start
            for i in range(len(items)):
                source = found[i][1]
                self._stats.hit_blocks[source] += 1
                self._stats.loaded_bytes[source] += self.codec.entry_bytes
        return True

    # ---- the engine's side ------------------------------------------------------------------

    def weights_changed(self) -> None:
        """The weights were written in place: what the tiers hold is for the old ones. The
        host tier is emptied and the disk tier moves to a namespace of this process alone
        (no later process can know these weights by their files)."""
        self.flush()
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self._writer.submit(lambda: None).result()  # the old namespace's writes end first
            self.disk = DiskTier(
                self.disk.root, f"{self._namespace}-{uuid.uuid4().hex[:12]}", self.disk.capacity_bytes
            )

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(
                dict(self._stats.hit_blocks),
                dict(self._stats.loaded_bytes),
                dict(self._stats.stored_bytes),
                self._stats.loads,
                self._stats.failed_loads,
                self._stats.load_seconds,
                self._stats.disk_writes_dropped,
            )
        if self.host is not None:
            s.host_used_bytes = self.host.used_bytes
            s.host_capacity_bytes = self.host.num_entries * self.host.entry_bytes
        if self.disk is not None:
            s.corrupt_files, s.disk_write_errors = self.disk.corrupt_files, self.disk.write_errors
            s.disk_full, s.disk_used_bytes, s.disk_capacity_bytes = (
                self.disk.full,
                self.disk.used_bytes,
                self.disk.capacity_bytes,
            )
        return s

    def close(self) -> None:
        """Finish queued writes (so a restart finds them) and stop the threads."""
        self.flush()
        self._loader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
