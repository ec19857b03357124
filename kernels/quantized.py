"""Weights that stay in their stored fp8 / fp4 formats: ``deepinfer::fp8_block_linear`` and
``deepinfer::routed_experts_fp4``.

The released V4 checkpoints keep most linears as fp8 e4m3 with one power-of-two scale per
weight block, and routed experts as fp4 e2m1 (two per byte) with one ue8m0 scale per 32
input channels (``weights/quant.py``). Dequantizing them on load to 16
bits makes resident weights twice (fp8) to four times (fp4) the files. These ops keep the
stored bytes and dequantize one tile at
a time inside the matmul: a block of weight rows for the fp8 linear, one expert's three
matrices for the routed experts, never a whole weight. Dequantization is exact (fp8 and e2m1
values times a power of two are representable in fp32), so the result is the dequantize-on-
load path's matmul up to summation order.

The references here run on every device; each op is opaque to ``torch.compile``. On CUDA
both run Triton kernels (``quantized_triton.py``: codes decoded and scaled in registers,
nothing dequantized in memory; checked on CPU under Triton's interpreter).
``torch._scaled_mm`` with block scales (which rounds activations to fp8) is not used.

The fp4 experts' reference loops over the experts that got tokens, reading the counts on the
host; a CUDA graph cannot capture that. CUDA and ``meta`` tensors run the grouped form
(``routed_experts_fp4_grouped``): pairs sorted by expert on the device and every matmul over
fixed shapes, each row meeting its own expert's weights (a grouped Triton kernel on CUDA; a
gather of each pair's expert, a chunk of pairs at a time, elsewhere). The CPU, which never
captures, keeps the loop: it dequantizes each active expert once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from deepinfer.kernels.moe import _combine, _sort_by_expert, _swiglu, expert_offsets

# fp8 weight rows dequantized per step of the tile loop (rounded to whole scale blocks):
# 256 rows of a 7168-wide weight are 7 MiB of fp32
TILE_ROWS = 256
# (token, choice) pairs whose experts' fp4 matrices the gathered grouped form dequantizes at
# once: a chunk holds this many matrices in fp32
PAIR_CHUNK = 16


def dequantize_fp8_rows(
    weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, start: int, stop: int
) -> torch.Tensor:
    """Rows ``start:stop`` of an fp8 block-scaled weight in fp32 (``start`` on a block edge)."""
    rows = weight[start:stop].float()
    s = scale[start // block_n : math.ceil(stop / block_n)].float()
    s = s.repeat_interleave(block_n, 0)[: stop - start].repeat_interleave(block_k, 1)
    return rows * s[:, : weight.shape[1]]


@torch.library.custom_op("deepinfer::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    """``x`` [M, K] @ dequant(``weight`` [N, K] fp8 e4m3, ``scale`` [ceil(N / block_n),
    ceil(K / block_k)]).T -> [M, N] in ``x``'s dtype; rows of the weight dequantized a tile at
    a time."""
    n = weight.shape[0]
    out = x.new_empty(x.shape[0], n)
    tile = max(1, TILE_ROWS // block_n) * block_n
    for start in range(0, n, tile):
        stop = min(n, start + tile)
        w = dequantize_fp8_rows(weight, scale, block_n, block_k, start, stop)
        out[:, start:stop] = F.linear(x, w.to(x.dtype))
    return out


@fp8_block_linear.register_fake
def _(x, weight, scale, block_n, block_k):
    return x.new_empty(x.shape[0], weight.shape[0])


def _register_device_kernels() -> None:
    """The sync-free fp4 experts for ``meta`` tensors (what the capture checks walk), and for
    CUDA ones the Triton kernels when there is a GPU and Triton is installed (checked here,
    not on CPU-only machines, where importing Triton only costs time), else the gathered
    grouped form."""
    routed_experts_fp4.register_kernel("meta")(routed_experts_fp4_gathered)
    if not torch.cuda.is_available():
        return
    from deepinfer.kernels.quantized_triton import fp8_block_linear_triton, triton

    if triton is None:
        routed_experts_fp4.register_kernel("cuda")(routed_experts_fp4_gathered)
        return
    fp8_block_linear.register_kernel("cuda")(fp8_block_linear_triton)
    routed_experts_fp4.register_kernel("cuda")(routed_experts_fp4_triton)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes (bit 3 the sign; the OCP MX order) as fp32 values, by arithmetic on the
    code bits (no constant table: a captured step copies nothing from the host)."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(exponent == 0, mantissa * 0.5, torch.exp2(exponent.float() - 1) * (1 + mantissa * 0.5))
    return torch.where((c >> 3) == 1, -mag, mag)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """fp4 bytes [N, K / 2] (low nibble first) with one scale per ``group`` values [N, K / group]
    -> fp32 [N, K]."""
    n, half = packed.shape
    byte = packed.view(torch.uint8)
    values = torch.stack((e2m1_values(byte & 0xF), e2m1_values(byte >> 4)), dim=-1).view(n, 2 * half)
    return (values.view(n, -1, group) * scale.float().unsqueeze(-1)).view(n, 2 * half)


def fp4_expert_loop(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packed: tuple[torch.Tensor, ...], limit: float
) -> torch.Tensor:
    """The routed experts over fp4 weights ``packed`` = (w1, s1, w2, s2, w3, s3), each
    expert that has tokens dequantized alone and run on its rows (host-read counts)."""
    w1, s1, w2, s2, w3, s3 = packed
    flat_ids, order, picked = _sort_by_expert(x, ids)
    counts = torch.bincount(flat_ids, minlength=w1.shape[0]).tolist()
    outs, start = [], 0
    for e, count in enumerate(counts):
        if not count:
            continue
        rows = picked[start : start + count]
        hidden = _swiglu(
            _dequantized_linear(rows, w1[e], s1[e]), _dequantized_linear(rows, w3[e], s3[e]), limit
        )
        outs.append(_dequantized_linear(hidden, w2[e], s2[e]))
        start += count
    if not outs:
        return torch.zeros_like(x)
    return _combine(x, torch.cat(outs), weights, order, ids.shape[1])


def _dequantized_linear(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, dequantize_fp4(packed, scale).to(rows.dtype))


class ExpertRows(NamedTuple):
    """Where the pairs sorted by expert sit, on the device: each sorted row's expert [P] and
    each expert's end row [E] (int32)."""

    experts: torch.Tensor
    offsets: torch.Tensor


# a grouped fp4 matmul: (rows [P, K] sorted by expert, where they sit, packed [E, N, K/2],
# scales [E, N, K/32]) -> [P, N], each row times its own expert's matrix
GroupedLinear = Callable[[torch.Tensor, ExpertRows, torch.Tensor, torch.Tensor], torch.Tensor]


def gathered_fp4_linear(
    rows: torch.Tensor, where: ExpertRows, packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Each row times its own expert's matrix, the experts gathered per pair and dequantized
    ``PAIR_CHUNK`` pairs at a time (fixed shapes; an expert shared by pairs is decoded once
    for each)."""
    n, half = packed.shape[1:]
    outs = []
    for start in range(0, rows.shape[0], PAIR_CHUNK):
        experts = where.experts[start : start + PAIR_CHUNK]
        w = dequantize_fp4(packed[experts].flatten(0, 1), scale[experts].flatten(0, 1))
        w = w.view(len(experts), n, 2 * half).to(rows.dtype)
        chunk = rows[start : start + PAIR_CHUNK].unsqueeze(1)
        outs.append(torch.bmm(chunk, w.transpose(1, 2)).squeeze(1))
    return torch.cat(outs) if outs else rows.new_empty(0, n)


def routed_experts_fp4_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    packed: tuple[torch.Tensor, ...],
    limit: float,
    linear: GroupedLinear,
) -> torch.Tensor:
    """The fp4 experts with no host read: pairs sorted by expert on the device and each of
    the three matmuls one grouped ``linear`` over all of them."""
    w1, s1, w2, s2, w3, s3 = packed
    flat_ids, order, picked = _sort_by_expert(x, ids)
    where = ExpertRows(flat_ids[order], expert_offsets(flat_ids, w1.shape[0]))
    hidden = _swiglu(linear(picked, where, w1, s1), linear(picked, where, w3, s3), limit)
    return _combine(x, linear(hidden, where, w2, s2), weights, order, ids.shape[1])


def routed_experts_fp4_gathered(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *packed_and_limit):
    """``deepinfer::routed_experts_fp4`` (same arguments) in the grouped form over
    ``gathered_fp4_linear``: the op's ``meta`` kernel, and its CUDA one without Triton."""
    *packed, limit = packed_and_limit
    return routed_experts_fp4_grouped(x, weights, ids, tuple(packed), limit, gathered_fp4_linear)


def routed_experts_fp4_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *packed_and_limit):
    """``deepinfer::routed_experts_fp4`` (same arguments) in the grouped form over the grouped
    Triton kernel (``quantized_triton.fp4_grouped_linear_triton``; weights decoded in registers)."""
    from deepinfer.kernels.quantized_triton import fp4_grouped_linear_triton

    *packed, limit = packed_and_limit
    return routed_experts_fp4_grouped(x, weights, ids, tuple(packed), limit, fp4_grouped_linear_triton)


@torch.library.custom_op("deepinfer::routed_experts_fp4", mutates_args=())
def routed_experts_fp4(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``deepinfer::routed_experts`` with the experts stored as fp4: ``w1``/``w3`` [E, I, d/2]
    and ``w2`` [E, d, I/2] packed e2m1 bytes, ``s1``/``s3`` [E, I, d/32] and ``s2``
    [E, d, I/32] ue8m0 scales. Each expert that has tokens is dequantized alone, runs its
    tokens, and is dropped (on CUDA and ``meta``: the grouped form, no host read)."""
    return fp4_expert_loop(x, weights, ids, (w1, s1, w2, s2, w3, s3), limit)


@routed_experts_fp4.register_fake
def _(x, weights, ids, w1, s1, w2, s2, w3, s3, limit):
    return torch.empty_like(x)


_register_device_kernels()
