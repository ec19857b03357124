"""The int8 K/V cache row format (``kv_cache_dtype="int8"``): what llama.cpp's q8_0 stores,
with fp32 scales.

Each run of ``BLOCK`` (32) values of a row becomes int8 codes ``round(x / s)`` with
``s = max|x| / 127`` (symmetric, rounded half to even; a block of zeros has ``s = 0`` and codes
0). A row of ``dim`` values is ``dim`` code bytes followed by ``dim / 32`` fp32 scales in the
machine's byte order, so a pool of such rows is one int8 tensor ``row_width(dim)`` wide and
travels through block tables, copies and compiled steps like any other pool. The CPU kernels
(``cpu/int8_rows.h``) write and read the same bits as ``encode`` and ``read``.

Keys are stored in a rotated basis: after RoPE, each head's query and key go through the same
orthonormal Walsh-Hadamard transform (``rotate``), which leaves every query-key product as it
was but spreads a head's few large channels over all of its values, so one scale per 32 values
no longer has to span an outlier (``benchmarks/RESULTS.md`` has what it saves). llama.cpp
rotates its quantized caches the same way (``attn_rot`` in its ``llama-kv-cache.cpp``; the idea
is QuaRot's, Ashkboos et al., 2024). Values are stored as they are: their rounding costs a
small part of what the keys' does.
"""

from __future__ import annotations

import math

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


def rotation_size(head_dim: int) -> int:
    """The Walsh-Hadamard block of a head: the largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


def rotates(dtype: torch.dtype) -> bool:
    """Whether a K pool of ``dtype`` holds keys in the rotated basis (only int8's does)."""
    return dtype == torch.int8


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] times the orthonormal Sylvester Hadamard matrix of each
    ``rotation_size`` block, in fp32 (its own inverse). The butterflies run in the order of
    the CPU kernel's ``fwht`` (``cpu/int8_rows.h``), so both give the same bits."""
    d = x.shape[-1]
    n = rotation_size(d)
    y = x.float().reshape(-1, d // n, n)
    s = 1
    while s < n:
        pairs = y.view(-1, d // n, n // (2 * s), 2, s)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).view(-1, d // n, n)
        s *= 2
    return (y * torch.tensor(1 / math.sqrt(n), dtype=torch.float32)).view(x.shape)
