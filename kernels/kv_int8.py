"""The int8 K/V cache row format (``kv_cache_dtype="int8"``): what llama.cpp's q8_0 stores,
with fp32 scales.

Each run of ``BLOCK`` (32) values of a row becomes int8 codes ``round(x / s)`` with
``s = max|x| / 127`` (symmetric, rounded half to even; a block of zeros has ``s = 0`` and codes
0). A row of ``dim`` values is ``dim`` code bytes followed by ``dim / 32`` fp32 scales in the
machine's byte order, so a pool of such rows is one int8 tensor ``row_width(dim)`` wide and
travels through block tables, copies and compiled steps like any other pool. The CPU kernels
(``cpu/int8_rows.h``) write and read the same bits as ``encode`` and ``read``.
A Llama-family model stores its keys rotated (``kv_rotation``).
"""

from __future__ import annotations

import torch

# values per scale, and the largest code
BLOCK, MAX_CODE = 32, 127


def row_width(dim: int, dtype: torch.dtype) -> int:
    """Elements of a pool row of ``dtype`` holding ``dim`` values (an int8 row adds its
    scales' bytes)."""
    if dtype != torch.int8:
        return dim
    if dim % BLOCK:
        raise ValueError(f"an int8 K/V cache stores rows in blocks of {BLOCK} values; a row here has {dim}")
    return dim + dim // BLOCK * 4


def values_per_row(pool: torch.Tensor) -> int:
    """Values one row of ``pool`` holds (the inverse of ``row_width``)."""
    width = pool.shape[-1]
    return width * BLOCK // (BLOCK + 4) if pool.dtype == torch.int8 else width


def encode(values: torch.Tensor) -> torch.Tensor:
    """[N, dim] values -> [N, row_width(dim, int8)] int8 rows: codes, then fp32 scales."""
    n, dim = values.shape
    g = values.float().reshape(n, dim // BLOCK, BLOCK)
    scale = g.abs().amax(dim=-1, keepdim=True) / MAX_CODE
    codes = torch.where(scale > 0, g / scale, 0.0).round().clamp(-MAX_CODE, MAX_CODE).to(torch.int8)
    return torch.cat([codes.view(n, dim), scale.view(n, -1).view(torch.int8)], dim=1)


def read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., width] as values [..., dim] in ``dtype`` (int8 rows decoded, other
    element types cast)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    dim = values_per_row(rows)
    lead = rows.shape[:-1]
    codes = rows[..., :dim].float().view(*lead, dim // BLOCK, BLOCK)
    scale = rows[..., dim:].contiguous().view(torch.float32).unsqueeze(-1)
    return (codes * scale).view(*lead, dim).to(dtype)
