"""The host tier: fixed-size entries in one CPU buffer (pinned where the pool is on a GPU, so
copies overlap compute; a lazily mapped anonymous region on the CPU, so an unused budget costs
nothing), least recently used evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from deepinfer.cache.pools import _zeros


class HostTier:
    """At most ``capacity_bytes // entry_bytes`` entries, by key; thread-safe (the loader reads
    while the engine stores)."""

    def __init__(self, capacity_bytes: int, entry_bytes: int, pinned: bool) -> None:
        self.entry_bytes = entry_bytes
        self.num_entries = capacity_bytes // entry_bytes if entry_bytes else 0
        shape = (max(self.num_entries, 1), entry_bytes)
        if pinned and self.num_entries:
            self.buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        else:
            self.buffer = _zeros(*shape, dtype=torch.uint8, device="cpu")
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> entry
        self._free = list(range(self.num_entries - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.entry_bytes

    def has(self, key: bytes) -> bool:
        return key in self._index

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used; whether it is held."""
        with self._lock:
            if key not in self._index:
                return False
            self._index.move_to_end(key)
            return True

    def put(self, key: bytes, row: torch.Tensor) -> None:
        """Keep ``row`` under ``key`` (a held key is only marked as recently used)."""
        if not self.num_entries:
            return
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            entry = self._free.pop() if self._free else self._index.popitem(last=False)[1]
            self.buffer[entry].copy_(row)
            self._index[key] = entry

    def get(self, key: bytes) -> torch.Tensor | None:
        """A copy of the entry under ``key``, or None."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.move_to_end(key)
            return self.buffer[entry].clone()

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._free = list(range(self.num_entries - 1, -1, -1))
