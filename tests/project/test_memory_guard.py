"""The suite's memory bound (tests/support/memory_guard.py) fails a runaway test fast, by name."""

from __future__ import annotations

import ctypes
import gc
import mmap
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from memory_guard import MemoryBoundExceeded, MemoryGuard, rss_bytes, trim_heap

_MIB = 1 << 20
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # memory_guard.py


@pytest.fixture
def make_guard():
    """Guards made by the test; their threads stop at its end."""
    made: list[MemoryGuard] = []

    def make(bound: int, hard_bound: int) -> MemoryGuard:
        made.append(MemoryGuard(bound, hard_bound))
        return made[-1]

    yield make
    for guard in made:
        guard.close()


def grow(chunks: list[mmap.mmap], most: int) -> None:
    """Maps (and touches every page of) 16 MiB at a time, up to ``most`` bytes, with a pause
    between chunks so the guard's thread gets its turn however loaded the machine is. Fresh
    anonymous mappings, not the heap: memory that earlier tests freed stays resident in the
    allocator (the engine keeps freed heap memory mapped), and heap chunks would reuse it
    without growing the resident size."""
    while len(chunks) * 16 * _MIB < most:
        chunk = mmap.mmap(-1, 16 * _MIB)
        for offset in range(0, 16 * _MIB, mmap.PAGESIZE):
            chunk[offset] = 1
        chunks.append(chunk)
        time.sleep(0.01)


def settled_rss() -> int:
    """This process's resident bytes once earlier tests' unreachable objects are freed and the
    heap they left is handed back, as ``watching`` does at a test's start: a collection or a
    trim during the test would hand pages back and hide the growth it measures (after a
    worker's engine tests, gigabytes of freed heap)."""
    gc.collect()
    trim_heap()
    return rss_bytes()


def test_a_test_past_the_bound_fails_with_its_name(make_guard) -> None:
    base = settled_rss()
    guard = make_guard(base + 128 * _MIB, base + 8192 * _MIB)
    chunks: list[mmap.mmap] = []
    with pytest.raises(MemoryBoundExceeded, match="runaway-test grew this process to"):
        with guard.watching("runaway-test"):
            grow(chunks, 2048 * _MIB)
    # raised before the whole 2 GiB were taken (how far past the bound depends on how soon a
    # loaded machine schedules the guard's thread)
    assert len(chunks) * 16 * _MIB < 2048 * _MIB
    for chunk in chunks:
        chunk.close()


def test_a_test_under_the_bound_runs_to_its_end(make_guard) -> None:
    # the mutation of the check above: the same growth under a bound it never reaches
    base = settled_rss()
    guard = make_guard(base + 4096 * _MIB, base + 8192 * _MIB)
    chunks: list[mmap.mmap] = []
    with guard.watching("bounded-test"):
        grow(chunks, 256 * _MIB)
    assert len(chunks) * 16 * _MIB >= 256 * _MIB
    for chunk in chunks:
        chunk.close()


def test_between_tests_nothing_is_raised(make_guard) -> None:
    guard = make_guard(rss_bytes() + 4096 * _MIB, 1 << 62)
    with guard.watching("finished-test"):  # the guard has a test thread to raise in from now on
        pass
    guard.bound = 1  # every process is past this bound now
    deadline = time.monotonic() + 0.5  # ten of the guard's samples
    while time.monotonic() < deadline:
        time.sleep(0.01)
    # (a guard that forgot the test ended would have raised MemoryBoundExceeded here)


def test_a_native_call_past_the_hard_bound_ends_the_process_naming_the_test() -> None:
    code = f"""
    import sys
    sys.path.insert(0, {str(SUPPORT)!r})
    import torch
    from memory_guard import MemoryGuard, rss_bytes
    guard = MemoryGuard(bound=rss_bytes() + (64 << 20), hard_bound=rss_bytes() + (256 << 20))
    with guard.watching("native-runaway"):
        torch.ones(1 << 30, dtype=torch.float32)  # one native call filling 4 GiB
    print("survived")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 70, (done.returncode, done.stdout, done.stderr)
    assert "native-runaway grew this process to" in done.stderr
    assert "survived" not in done.stdout


def test_freed_heap_memory_the_allocator_keeps_is_not_counted(make_guard) -> None:
    # the engine keeps up to 1 GiB of freed heap memory mapped per arena (platforms/cpu.py):
    # a test that runs after engines freed theirs must not fail for memory nobody holds
    from deepinfer.platforms.cpu import tune_malloc

    if not tune_malloc():
        pytest.skip("needs glibc's mallopt")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(_MIB) for _ in range(512)]
    for block in blocks:
        ctypes.memset(block, 1, _MIB)
    held = rss_bytes()
    for block in reversed(blocks):  # freed by an earlier test
        libc.free(block)
    assert rss_bytes() > held - 128 * _MIB, "the allocator handed the freed heap back at once"
    guard = make_guard(held - 256 * _MIB, held + 8192 * _MIB)
    with guard.watching("after-engines-test"):
        time.sleep(0.5)
    assert rss_bytes() < held - 256 * _MIB
