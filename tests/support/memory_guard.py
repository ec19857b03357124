"""A memory bound per test process: a test that outgrows it fails at once, by name.

Without a bound a runaway test grows until the kernel's OOM killer ends a worker (or a process
beside it), and pytest-xdist can then wait on that worker for ever. Here a thread samples the
process's resident memory; past the bound it raises ``MemoryBoundExceeded`` in the test's thread,
which fails the running test and frees what its frames held. If that thread is stuck in one
long native call that keeps allocating, the process exits past a hard bound, naming the test,
and xdist reports the worker as crashed on it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_GIB = 1 << 30


class MemoryBoundExceeded(BaseException):
    """Raised in the test's thread; a BaseException so that no ``except Exception`` (or a
    hypothesis shrink loop) swallows it and goes on allocating."""


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/statm`` (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; thread-safe)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_memory() -> None:
    """Collect garbage and trim the heap, so the test after a runaway one starts from what the
    process really holds."""
    gc.collect()
    trim_heap()


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_bound_bytes(workers: int) -> int:
    """An equal share of the machine for each worker, one share kept for everything else."""
    return total_memory_bytes() // (workers + 1)


class MemoryGuard:
    """Watches one process. ``bound`` fails the running test; ``hard_bound`` ends the process."""

    def __init__(self, bound: int, hard_bound: int | None = None, interval_s: float = 0.05) -> None:
        if bound <= 0:
            raise ValueError(f"bound must be positive, got {bound}")
        self.bound = bound
        self.hard_bound = hard_bound if hard_bound is not None else bound + bound // 4
        self.interval_s = interval_s
        self._test: str | None = None
        self._raised = False
        self._target: int | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-guard", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> MemoryGuard:
        """``DEEPINFER_TEST_MAX_RSS_GB`` when set, else an equal share for each xdist worker."""
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        value = os.environ.get("DEEPINFER_TEST_MAX_RSS_GB")
        bound = int(float(value) * _GIB) if value else default_bound_bytes(workers)
        return cls(bound)

    @contextmanager
    def watching(self, test: str) -> Iterator[None]:
        """Applies the bound while ``test`` runs (setup, call and teardown). A process past half
        its bound first hands back the heap memory earlier tests freed, which the allocator
        keeps mapped (the CPU platform keeps up to 1 GiB per arena): it is no test's, and
        counted it would fail the next test that grows a little."""
        if rss_bytes() > self.bound // 2:
            trim_heap()
        with self._lock:
            self._test, self._raised, self._target = test, False, threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._test, raised = None, self._raised
            if raised:
                release_memory()

    def close(self) -> None:
        """Stops the watching thread."""
        self._closed.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._closed.wait(self.interval_s):
            rss = rss_bytes()
            with self._lock:
                test, raised = self._test, self._raised
                if test is None or self._target is None or rss <= self.bound:
                    continue
                if rss > self.hard_bound:
                    sys.stderr.write(self._message(test, rss, self.hard_bound) + "; ending the process\n")
                    sys.stderr.flush()
                    os._exit(70)
                if not raised:
                    self._raised = True
                    self._raise_in_test(self._target, self._message(test, rss, self.bound))

    @staticmethod
    def _message(test: str, rss: int, bound: int) -> str:
        return f"{test} grew this process to {rss / _GIB:.2f} GiB, past the bound of {bound / _GIB:.2f} GiB"

    @staticmethod
    def _raise_in_test(thread: int, message: str) -> None:
        """Schedules ``MemoryBoundExceeded(message)`` in the test's thread, raised at its next
        Python bytecode (after a native call returns)."""
        # PyThreadState_SetAsyncExc takes a class, instantiated with no arguments: a subclass
        # carries the message
        cls = type(
            "MemoryBoundExceeded",
            (MemoryBoundExceeded,),
            {"__init__": lambda self, text=message: BaseException.__init__(self, text)},
        )
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(cls))
