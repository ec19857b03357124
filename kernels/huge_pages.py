"""Packed CPU weights in memory advised for transparent huge pages (Linux ``MADV_HUGEPAGE``).

A decode step streams every weight once, hundreds of MB at B = 1, and with 4 KiB pages each
page costs a TLB miss and stops the hardware prefetchers at its boundary. Where the kernel's
transparent huge pages are in ``madvise`` mode (a common default), memory must ask for them;
SmolLM2's packed projections at one row run faster from 2 MiB pages (benchmarks/RESULTS.md).

``HugePageArena.adopt(t)`` returns a copy of a large tensor placed in an arena of anonymous
mappings aligned to 2 MiB and advised for huge pages (small tensors, other platforms, or no
arena: ``t`` itself). Tensors are bump-allocated and never moved; a chunk is unmapped when the
last tensor in it and the arena's reference to it are gone. Touching the pages is the copy's job,
so nothing is resident before it."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # one mapping serves many weights: at most one chunk's tail is left unused
MIN_BYTES = 1 << 20  # smaller tensors stay where they are (a few pages, little to gain)
ALIGN = 64  # a cache line: the kernels' vector loads never straddle one more than needed
_MADV_HUGEPAGE = 14


def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


class HugePageArena:
    """Tensors bump-allocated in chunks of anonymous memory advised for huge pages. Whoever
    prepares weights owns one (an engine whose ``cpu_huge_pages`` is on), and passes it to
    the code that packs them; without one, packed weights stay in ordinary memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: mmap.mmap | None = None
        self._base = 0  # the chunk's first 2 MiB-aligned offset
        self._used = 0
        self._size = 0

    def _new_chunk(self, nbytes: int) -> None:
        """Map a chunk of at least ``nbytes`` (2 MiB-aligned inside the mapping) and advise it."""
        size = max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        chunk = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
        base = -(-address // HUGE_PAGE) * HUGE_PAGE
        assert _MADVISE is not None
        _MADVISE(base, size, _MADV_HUGEPAGE)  # a refusal (THP off) leaves ordinary pages
        self._chunk, self._base, self._used, self._size = chunk, base - address, 0, size

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in huge-page-advised memory, or ``t`` itself where that
        does not apply (small, not a plain CPU tensor, no ``madvise``)."""
        nbytes = t.numel() * t.element_size()
        if (
            _MADVISE is None
            or nbytes < MIN_BYTES
            or t.device.type != "cpu"
            or t.layout != torch.strided  # also oneDNN's opaque tensors
        ):
            return t
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._size:
                self._new_chunk(nbytes)
            assert self._chunk is not None
            start = self._base + self._used
            self._used += -(-nbytes // ALIGN) * ALIGN
            raw = torch.frombuffer(self._chunk, dtype=torch.uint8, count=nbytes, offset=start)
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


def adopt(t: torch.Tensor, arena: HugePageArena | None) -> torch.Tensor:
    """``t`` placed in ``arena`` (None: ``t`` itself)."""
    return t if arena is None else arena.adopt(t)
