"""Builds the C++ CPU kernels with Inductor's compiler driver (``CppCodeCache``): the flags,
vector-ISA pick and on-disk cache Inductor uses for its own generated kernels, so a kernel is
compiled once per machine and loaded from the cache afterwards. Sources use ATen's portable
``at::vec::Vectorized`` (AVX2, AVX-512, NEON or scalar)."""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def load(source: str) -> ctypes.CDLL | None:
    """The built library, or None where building fails (no compiler): callers fall back to
    PyTorch's kernels."""
    try:
        from torch._inductor.codecache import CppCodeCache

        return CppCodeCache.load(source)
    except Exception as exc:
        logger.warning("CPU kernels unavailable (%s); using PyTorch's", exc)
        return None


def bind(lib: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn
