"""KV blocks between two servers over torch.distributed point-to-point on gloo.

The transfer engines made for this (Mooncake's, NIXL) ship CUDA builds only, which do not load
on a CPU-only machine; gloo's send and recv carry the bytes instead, through a private
``ProcessGroupGloo`` per connection (never the default group, which tensor parallel owns). A
prefill server hosts a ``TCPStore``; a decode server takes a connection number from it
(``store.add``), marks the connection ready, and both sides build a two-rank group under that
number's prefix, the prefill server as rank 0.

A fetch is: the keys (block hashes, 32 bytes each) to the sender; back come a flag per key
(held or not), the held blocks' rows, and the SHA-256 of those rows, which the receiver checks
(as the disk tier checks its files). A dead or stalled peer fails the collective within the
group's timeout; the receiver then reports every key missing and drops the connection.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("deepinfer")

KEY_BYTES = 32  # SHA-256 block hashes (``cache/prefix_hash.py``)
_CONNECTIONS = "deepinfer/kv/connections"
_SERVE_TIMEOUT = timedelta(minutes=5)  # a fetch's parts arrive within this once it is announced
_POLL = timedelta(seconds=1)  # a sender's store waits, between which it sees that it was closed


def _ready(n: int) -> str:
    return f"deepinfer/kv/ready/{n}"


def _asked(n: int, seq: int) -> str:
    """The store key a receiver sets before its ``seq``-th message on connection ``n``: the
    sender waits on the store (in short waits it leaves once closed), never idle in a recv."""
    return f"deepinfer/kv/{n}/fetch/{seq}"


def _group(store: dist.TCPStore, n: int, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(f"deepinfer/kv/{n}", store), rank, 2, timeout)


def digest(rows: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a [n, bytes] uint8 tensor's bytes, as a uint8 tensor."""
    return torch.frombuffer(bytearray(hashlib.sha256(rows.numpy().tobytes()).digest()), dtype=torch.uint8)


class BlockSender:
    """A prefill server's side: answers every connection's fetches from ``read`` (a block's row
    by hash, or None), on a thread per connection."""

    def __init__(
        self, read: Callable[[bytes], torch.Tensor | None], entry_bytes: int, host: str, port: int
    ) -> None:
        self.read, self.entry_bytes = read, entry_bytes
        self.store = dist.TCPStore(host, port, None, is_master=True, wait_for_workers=False)
        self.host, self.port = host, self.store.port
        self.closed = False
        self.served_blocks = 0
        self._threads: list[threading.Thread] = []
        self._start(self._accept, "deepinfer-kv-accept")

    def _start(self, target: Callable[..., None], name: str, *args: int) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _wait(self, store: dist.TCPStore, key: str) -> bool:
        """Wait for ``key`` in the store; False once closed."""
        while not self.closed:
            try:
                store.wait([key], _POLL)
                return True
            except Exception:  # not set yet: the wait timed out
                continue
        return False

    def _accept(self) -> None:
        n = 1
        while self._wait(self.store, _ready(n)):
            self._start(self._serve, f"deepinfer-kv-send-{n}", n)
            n += 1

    def _serve(self, n: int) -> None:
        try:
            # a client of its own: one store object's waits run one at a time
            store = dist.TCPStore(self.host, self.port, None, is_master=False)
            group = _group(store, n, 0, _SERVE_TIMEOUT)
            seq = 1
            while self._wait(store, _asked(n, seq)):
                store.delete_key(_asked(n, seq))
                seq += 1
                head = torch.zeros(1, dtype=torch.int64)
                group.recv([head], 1, 0).wait()
                count = int(head.item())
                if count <= 0:
                    return
                keys = torch.empty(count * KEY_BYTES, dtype=torch.uint8)
                group.recv([keys], 1, 1).wait()
                rows = [self.read(bytes(k.tolist())) for k in keys.view(count, KEY_BYTES)]
                flags = torch.tensor([r is not None for r in rows], dtype=torch.uint8)
                group.send([flags], 1, 2).wait()
                held = [r for r in rows if r is not None]
                if held:
                    data = torch.stack(held).contiguous()
                    group.send([data], 1, 3).wait()
                    group.send([digest(data)], 1, 4).wait()
                    self.served_blocks += len(held)
        except Exception as exc:  # the decode server went away: its connection ends
            logger.info("KV transfer connection %d ended: %s", n, exc)

    def close(self) -> None:
        """Stop accepting and serving: each thread leaves within one store wait."""
        self.closed = True
        for thread in self._threads:
            thread.join(timeout=2 * _POLL.total_seconds() + 1)


class BlockReceiver:
    """A decode server's connection to one prefill server's ``BlockSender``."""

    def __init__(self, host: str, port: int, entry_bytes: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        self.n = self.store.add(_CONNECTIONS, 1)
        self.store.set(_ready(self.n), b"1")
        self.group = _group(self.store, self.n, 1, timeout)
        self.entry_bytes = entry_bytes
        self.seq = 0

    def _announce(self, count: int) -> None:
        self.seq += 1
        self.store.set(_asked(self.n, self.seq), b"1")
        self.group.send([torch.tensor([count], dtype=torch.int64)], 0, 0).wait()

    def fetch(self, keys: list[bytes]) -> tuple[list[torch.Tensor | None], bool]:
        """The rows of ``keys`` (None where the sender holds none) and whether their checksum
        held (False: every row is dropped). Raises when the peer is gone or stalls."""
        group = self.group
        self._announce(len(keys))
        group.send([torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)], 0, 1).wait()
        flags = torch.empty(len(keys), dtype=torch.uint8)
        group.recv([flags], 0, 2).wait()
        held = int(flags.sum())
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not held:
            return out, True
        data = torch.empty(held, self.entry_bytes, dtype=torch.uint8)
        group.recv([data], 0, 3).wait()
        check = torch.empty(KEY_BYTES, dtype=torch.uint8)
        group.recv([check], 0, 4).wait()
        if not torch.equal(digest(data), check):
            return out, False
        rows = iter(data)
        return [next(rows) if f else None for f in flags.tolist()], True

    def close(self) -> None:
        """Tell the sender this connection ends (best effort)."""
        try:
            self._announce(0)
        except Exception:
            pass
