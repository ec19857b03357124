"""FP8 (e4m3, block scales) and FP4 (e2m1 packed two per byte, per-32 scales) weight formats.

The released V4 checkpoints store most linears as fp8 e4m3 with one power-of-two (ue8m0)
scale per ``weight_block_size`` block, and routed experts as fp4 e2m1 with one ue8m0 scale per
32 input channels. We dequantize on load.
"""

from __future__ import annotations

import math

import torch

from deepinfer.kernels.quantized import dequantize_fp4 as kernel_dequantize_fp4

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_BLOCK = 32
# e2m1 code -> value; bit 3 is the sign (the order of the OCP MX spec).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def pow2_scale(amax: torch.Tensor, qmax: float, floor: float = 1e-30) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (ue8m0 scales are powers of two);
    ``amax`` is clamped at ``floor`` first."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=floor) / qmax)))


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _expand_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 e4m3 [N, K], e8m0 scale [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    nb, kb = _blocks(n, k, block)
    padded = w.float().new_zeros(nb * block[0], kb * block[1])
    padded[:n, :k] = w.float()
    amax = padded.view(nb, block[0], kb, block[1]).abs().amax(dim=(1, 3))
    scale = pow2_scale(amax, FP8_MAX)
    q = (w.float() / _expand_scale(scale, w.shape, block)).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks`, in fp32."""
    expected = _blocks(q.shape[0], q.shape[1], block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8 scale has shape {tuple(scale.shape)}, expected {expected} for block {block}")
    return q.float() * _expand_scale(scale, q.shape, block)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (packed int8 [N, K/2], e8m0 scale [N, K/32]).

    Each value rounds to the nearest e2m1 code; the even element sits in the low nibble.
    """
    n, k = w.shape
    if k % FP4_BLOCK:
        raise ValueError(f"fp4 needs the input dim divisible by {FP4_BLOCK}, got {k}")
    groups = w.float().view(n, k // FP4_BLOCK, FP4_BLOCK)
    scale = pow2_scale(groups.abs().amax(dim=-1), FP4_MAX)
    scaled = (groups / scale.unsqueeze(-1)).view(n, k)
    table = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = codes | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`, in fp32: [N, K/2] bytes + [N, K/32] scales -> [N, K]
    (the decode the fp4 expert kernels use, after a shape check)."""
    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // FP4_BLOCK):
        raise ValueError(f"fp4 scale has shape {tuple(scale.shape)}, expected {(n, 2 * half // FP4_BLOCK)}")
    return kernel_dequantize_fp4(packed, scale, FP4_BLOCK)
