"""The disk tier: one file per block under ``kv_cache_dir/<namespace>/``, written atomically
(a temporary file renamed into place), checked on every read, bounded in bytes across every
namespace in the directory (least recently used files deleted first).

A file is ``MAGIC``, a header (payload and main-part lengths, the block's prefix hash) and the payload, followed by the SHA-256 of all of it: a truncated file, a
flipped byte or a file copied under another block's name fails the check and is deleted
with a warning, never loaded. A write that fails (a full disk, a quota) is reported, the
files held stay, and writes pause a while; the engine goes on serving."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger("deepinfer")

MAGIC = b"DIKVBLK1"
_HEADER = struct.Struct("<QQ32s")  # payload bytes, main-part bytes, prefix hash
_DIGEST = 32
_SUFFIX = ".kvb"
_STALE_TMP_S = 3600.0  # a temporary file this old is no live process's write in progress
_RETRY_S = 30.0  # after a failed write, writes pause this long


def _write_file(path: Path, chunks: list[bytes]) -> None:
    """Writes ``chunks`` to ``path`` (the one place the tier writes file data)."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


class DiskTier:
    """Files of one namespace (model, weights, cache format) under ``root``; thread-safe."""

    def __init__(self, root: Path, namespace: str, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.dir = self.root / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # every tier file -> size, LRU first
        self.used_bytes = 0
        self.corrupt_files = 0
        self.write_errors = 0
        self.full = False
        self._paused_until = 0.0
        self._scan()

    def _scan(self) -> None:
        """Index what earlier processes left, oldest first (by modification time)."""
        found = []
        for path in self.root.glob(f"*/*/*{_SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, path, st.st_size))
        for _, path, size in sorted(found, key=lambda item: item[0]):
            self._files[path] = size
            self.used_bytes += size
        stale = time.time() - _STALE_TMP_S
        for tmp in self.root.glob("*/*/*.tmp*"):  # left by a process that died mid-write
            try:
                if tmp.stat().st_mtime < stale:
                    tmp.unlink()
            except OSError:
                pass
        with self._lock:
            self._evict(0)

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}{_SUFFIX}"

    def has(self, key: bytes) -> bool:
        return self.path_of(key) in self._files

    def write(self, key: bytes, payload: bytes, main_bytes: int) -> bool:
        """Store ``payload`` under ``key``; False (reported, nothing kept) when it fails."""
        path = self.path_of(key)
        head = MAGIC + _HEADER.pack(len(payload), main_bytes, key)
        digest = hashlib.sha256(head + payload).digest()
        size = len(head) + len(payload) + _DIGEST
        with self._lock:
            if path in self._files or time.monotonic() < self._paused_until or size > self.capacity_bytes:
                return False
            self._evict(size)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            _write_file(tmp, [head, payload, digest])
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._write_failed(exc)
            return False
        with self._lock:
            self._files[path] = size
            self.used_bytes += size
            self.full = False  # a write went through again
        return True

    def _write_failed(self, exc: OSError) -> None:
        """A failed write (a full disk, a quota, a file-size limit, or another error): writes
        pause a while and the files held stay; the engine serves on."""
        self.write_errors += 1
        with self._lock:
            self.full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            self._paused_until = time.monotonic() + _RETRY_S
        logger.warning(
            "KV disk tier: writing a block under %s failed (%s); the tier keeps the %d bytes it holds, "
            "and writes pause for %.0f s",
            self.dir,
            exc,
            self.used_bytes,
            _RETRY_S,
        )

    def read(self, key: bytes, main_bytes: int) -> bytes | None:
        """The payload under ``key``, or None: missing, or failing its check (a main part of
        other than ``main_bytes``; the file is then deleted, with a warning)."""
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._drop(path)
            return None
        checked = self._check(data, key, main_bytes)
        if checked is None:
            self.corrupt_files += 1
            logger.warning("KV disk tier: %s failed its checksum or is truncated; ignored and deleted", path)
            path.unlink(missing_ok=True)
            self._drop(path)
            return None
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        try:
            os.utime(path)  # the order a restart evicts in
        except OSError:
            pass
        return checked

    @staticmethod
    def _check(data: bytes, key: bytes, main_bytes: int) -> bytes | None:
        start = len(MAGIC) + _HEADER.size
        if len(data) < start + _DIGEST or not data.startswith(MAGIC):
            return None
        length, stored_main, stored_key = _HEADER.unpack_from(data, len(MAGIC))
        if stored_key != key or stored_main != main_bytes or len(data) != start + length + _DIGEST:
            return None
        if hashlib.sha256(data[: start + length]).digest() != data[start + length :]:
            return None
        return data[start : start + length]

    def _drop(self, path: Path) -> None:
        with self._lock:
            size = self._files.pop(path, None)
            if size is not None:
                self.used_bytes -= size

    def _evict(self, incoming: int) -> None:
        """Delete least recently used files until ``incoming`` more bytes fit (lock held)."""
        while self._files and self.used_bytes + incoming > self.capacity_bytes:
            path, size = self._files.popitem(last=False)
            self.used_bytes -= size
            path.unlink(missing_ok=True)
