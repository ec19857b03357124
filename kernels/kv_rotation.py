"""The basis a Llama-family model's 8-bit K/V cache (int8, fp8) holds keys in.

After RoPE, each head's query and key go through the same orthonormal Walsh-Hadamard transform
(``rotate``), which leaves every query-key product as it was but spreads a head's few large
channels over all of its values: an int8 row's one scale per 32 values no longer has to span an
outlier, and an fp8 row's relative rounding falls on values of like size
(``benchmarks/RESULTS.md`` has what it saves). llama.cpp rotates its quantized caches the same
way (``attn_rot`` in its ``llama-kv-cache.cpp``; the idea is QuaRot's, Ashkboos et al., 2024).
Values are stored as they are: their rounding costs a small part of what the keys' does. The
C++ RoPE + cache-write kernel rotates in its own pass (``cpu/hadamard.h``), bitwise ``rotate``.
"""

from __future__ import annotations

import math

import torch

# K pool element types that hold keys rotated: the 8-bit ones
ROTATED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def rotation_size(head_dim: int) -> int:
    """The Walsh-Hadamard block of a head: the largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


def rotates(dtype: torch.dtype) -> bool:
    """Whether a K pool of ``dtype`` holds keys in the rotated basis (``ROTATED``)."""
    return dtype in ROTATED


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] times the orthonormal Sylvester Hadamard matrix of each
    ``rotation_size`` block, in fp32 (its own inverse). The butterflies run in the order of
    the CPU kernel's ``fwht`` (``cpu/hadamard.h``), so both give the same bits."""
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
