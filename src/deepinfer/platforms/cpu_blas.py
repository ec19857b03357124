"""MKL's threads for small CPU steps.

PyTorch's fp32 ``mm`` on the CPU is MKL's sgemm, which opens an OpenMP parallel region for
each call. For the few-row GEMMs of a small step (a short batch decoding, K = 64 on the tiny
V4) waking the other threads costs more than it shares: measured on this project's 2-core
machine, a batch-1 tiny-V4 decode step took 1.26 ms with MKL single-threaded for such steps
against 1.44 ms without; the offline throughput benchmark moved within the machine's noise
(RESULTS.md, sixteenth session). Larger steps keep every thread (256-row GEMMs ran 1.7x faster
threaded).

The switch is MKL's per-thread setting (``MKL_Set_Num_Threads_Local``, exported by the
MKL that PyTorch's x86 wheels link statically); PyTorch's own thread count is untouched, so
Inductor's kernels keep their threads. Where the symbol is absent (a build without MKL) this
does nothing."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

# Steps of at most this many token rows run MKL single-threaded (measured: 64 and 128 rows
# tied, 256 slower, 0 slower).
SINGLE_THREAD_ROWS = 64


@functools.cache
def _set_local_threads() -> ctypes._CFuncPtr | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _set_local_threads() is not None


@contextlib.contextmanager
def threads_for_step(rows: int) -> Iterator[None]:
    """Run the body (a step of ``rows`` token rows, on this thread) with MKL single-threaded
    if the step is small; the thread's previous setting comes back afterwards, so code
    around the engine never sees it."""
    fn = _set_local_threads() if rows <= SINGLE_THREAD_ROWS else None
    if fn is None:
        yield
        return
    previous = fn(1)
    try:
        yield
    finally:
        fn(previous)
