"""MKL's and OpenMP's threads for small CPU steps.

PyTorch's fp32 ``mm`` on the CPU is MKL's sgemm, which opens an OpenMP parallel region for
each call. For the few-row GEMMs of a small step (a short batch decoding, K = 64 on the tiny
V4) waking the other threads costs more than it shares, so a small decode step runs faster with
MKL single-threaded for those GEMMs (measured: benchmarks/RESULTS.md). Larger steps keep every
thread, where the work does outgrow the wake-up.

The switch is MKL's per-thread setting (``MKL_Set_Num_Threads_Local``, exported by the
MKL that PyTorch's x86 wheels link statically). Where the symbol is absent (a build without
MKL) this does nothing.

``openmp_for_step`` does the same for the OpenMP loops of a compiled step (Inductor's kernels,
ATen's parallel ops, our C++ kernels): ~80 parallel regions a tiny-V4 step, each waking the
other thread for a few microseconds of work in a small step. It must enclose only the call of
a step whose guards were already checked: dynamo's guards record ``torch.get_num_threads()``,
and a check under one thread would reject a variant traced under two. Running a kernel built
for two threads on one is correct: Inductor's loops are OpenMP worksharing loops, and a
parallel reduction's per-thread partials are sized and initialised for the build's count
before the region (``reduction_prefix_array`` in Inductor's ``codegen/cpp.py``)."""

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
# Steps of at most this many rows run a compiled step's OpenMP loops on one thread: the tiny
# V4's decode steps up to 16 rows ran faster on one thread, from 24 rows slower
# (benchmarks/RESULTS.md).
OPENMP_SINGLE_THREAD_ROWS = 16
# Thread counts the cut was measured at: with more threads a 16-row step may still gain from
# them, so other counts keep theirs until measured. (Inductor names the thread count in its
# kernels, ``num_threads(N)``, where it differs from the CPU count; the switch then reaches
# only ATen's and our own parallel loops.)
OPENMP_SWITCHED_THREADS = (2,)


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


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch runs on (the ``libgomp`` in ``torch/lib`` of the Linux
    wheels), or None where that file is absent or is not the runtime behind
    ``torch.get_num_threads()`` (checked once by setting it and reading torch's count)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        lib = ctypes.CDLL(path)
        lib.omp_get_max_threads.restype = ctypes.c_int
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    previous = torch.get_num_threads()  # first: torch sets this thread's count on first use
    lib.omp_set_num_threads(previous + 1)
    same = torch.get_num_threads() == previous + 1
    lib.omp_set_num_threads(previous)
    return lib if same else None


def openmp_available() -> bool:
    return _openmp() is not None


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


@contextlib.contextmanager
def openmp_for_step(rows: int) -> Iterator[None]:
    """Run the body (the call of a small step whose guards were checked, on this thread) with
    OpenMP at one thread; this thread's count (``torch.get_num_threads()``) comes back
    afterwards. Steps above ``OPENMP_SINGLE_THREAD_ROWS`` rows, and threads running another
    count than ``OPENMP_SWITCHED_THREADS``, keep every thread."""
    lib = _openmp() if rows <= OPENMP_SINGLE_THREAD_ROWS else None
    # torch's count, not the runtime's: torch sets a thread's count on its first parallel op,
    # and asking it first means that happens here rather than inside the body
    previous = torch.get_num_threads() if lib is not None else 1
    if lib is None or previous not in OPENMP_SWITCHED_THREADS:
        yield
        return
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(previous)
