"""Whether Triton is installed, asked once: the CUDA kernels of the fused ops run Triton where
it is and their plain form where it is not. Asked without importing Triton, so CPU-only
machines never load it."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
