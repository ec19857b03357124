"""CPU: eager by default (Inductor's first compile of a V4 step pays back only on long runs;
compile vs eager: benchmarks/RESULTS.md), no graph mode, no Triton kernels.

``replay_eagerly`` is a graph backend in name only: replay calls the function again on the
same static tensors. It lets the CPU tests exercise the graph runner's bucketing, padding
and static-buffer logic, which is the part that decides correctness on a GPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

from deepinfer.platforms import GraphOutput, Platform


def replay_eagerly(fn: Callable[[], GraphOutput]) -> Callable[[], GraphOutput]:
    fn()  # the warm-up run a real capture makes (it touches only null cache rows)
    return fn


logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: buffers up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # freed heap memory kept mapped before any is returned to the OS


@functools.cache
def tune_malloc() -> bool:
    """Serve allocations up to 32 MiB from glibc's heap and keep up to 1 GiB of freed heap
    memory mapped. With glibc's defaults a CPU step's large buffers keep going back to the OS
    (unmapped, or trimmed off the heap's top) and return as fresh pages, one page fault per 4
    KiB of activations, every step, and SmolLM2's GEMMs ran measurably slower inside a prefill
    than alone (a 1,024-token step allocates ~40 MB per layer). Both are set because setting
    either alone turns off glibc's dynamic threshold, which measured worse (RESULTS.md). True
    where applied (glibc), False elsewhere; once per process."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.info("mallopt refused the CPU allocation settings; keeping the C library's defaults")
    return ok


def cpu_platform() -> Platform:
    return Platform(name="cpu", compile_by_default=False, capture=None, has_triton=False)
