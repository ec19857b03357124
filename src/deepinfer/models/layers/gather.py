"""Row gathers from the paged cache pools."""

from __future__ import annotations

import torch

from deepinfer.cache.kv_formats import PackedRows, decode


def gather_rows(pool: torch.Tensor | PackedRows, idx: torch.Tensor) -> torch.Tensor:
    """``pool[idx]`` for a 2-D pool and any index shape, via ``index_select`` (several times
    faster than advanced indexing on CPU for the per-step gathers); a pool packed in a
    trained-precision format decodes the rows it gathers."""
    if isinstance(pool, PackedRows):
        rows = pool.data.index_select(0, idx.reshape(-1)).view(*idx.shape, pool.data.shape[-1])
        return decode(pool.fmt, rows, pool.dim, pool.dtype)
    return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, pool.shape[-1])
