"""Sleep mode: hand the K/V cache's memory (level 1) and the weights' (level 2) back to the
system between uses of an engine, as RL trainers do between rollouts (vLLM's ``LLM.sleep``,
SGLang's ``release_memory_occupation``).

The pools stay where they are: every page wholly inside a CPU pool is returned with
``madvise(MADV_DONTNEED)``, which a private mapping refills with zeros on the next touch, and
the partial pages at a pool's ends are zeroed. Addresses never change, so the one-call decode
stack's tables and compiled steps stay valid, and the cache is as a new engine's: zeroed, with
no prefix cached (its blocks no longer hold what their hashes name).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

from deepinfer.models.base import CausalLM
from deepinfer.models.layers.projection import projections


def release(t: torch.Tensor) -> None:
    """Zero ``t``, returning the pages wholly inside it to the system (a CPU tensor on Linux)."""
    page = mmap.PAGESIZE
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    flat = t.view(-1).view(torch.uint8) if t.is_contiguous() else None
    if t.device.type != "cpu" or flat is None or last <= first or not sys.platform.startswith("linux"):
        t.zero_()
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a cache pool")
    flat[: first - start].zero_()
    flat[last - start :].zero_()


def release_tensors(tensors: list[torch.Tensor]) -> None:
    """``release`` each of ``tensors`` (the K/V pools' tensors: ``memory.cache_tensors``)."""
    for tensor in tensors:
        release(tensor)


def release_weights(model: CausalLM, params: bool) -> None:
    """Give back the pages of the engine's own weight copies (fused, packed, quantized) and,
    with ``params``, of the model's parameters: each storage once, whole. The addresses stay;
    waking writes the values again in place (``LLM.wake_up``)."""
    tensors: list[torch.Tensor] = list(model.parameters()) if params else []
    for projection in projections(model):
        if not projection.shares:
            tensors += [t for t in (projection.fused_weight, projection.fused_bias) if t is not None]
        if projection.engine is not None and not callable(getattr(projection.engine, "func", None)):
            tensors += [t for t in vars(projection.engine).values() if isinstance(t, torch.Tensor)]
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()} if not params else set()
    seen: set[int] = set()
    for t in tensors:
        if t.layout != torch.strided or t.is_mkldnn:
            continue  # oneDNN's opaque copies are made again, not emptied
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.data_ptr() in owned or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        release(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
