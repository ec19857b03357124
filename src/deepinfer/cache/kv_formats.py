"""Cache rows stored in the precision the model was trained for.

With QAT fake-quant on, every value written to the window K=V, the compressed entries and the
indexer keys is already an fp8 / fp4 value times a per-block scale. Storing it in the compute
dtype wastes bytes; these formats store the codes and the scales, and reading decodes them to
exactly the values written (bitwise: each format's decode of its encode of a fake-quantized
tensor is that tensor, tests/cache/test_kv_formats.py):

- ``fp8_pow2_32`` (window K=V): e4m3 codes, one power-of-two (e8m0) scale per 32 values;
- ``fp4_e4m3_16`` (compressed entries): e2m1 codes two per byte, one e4m3 scale per 16;
- ``fp4_pow2_32`` (indexer keys): e2m1 codes two per byte, one e8m0 scale per 32.

A pool in such a format is a ``PackedRows``: one uint8 row per cache row, codes then scales.
``gather_rows`` and ``ForwardBatch.write`` decode and encode; nothing else touches them.
Decoding is arithmetic only (no constant tables), so a captured step copies nothing from the
host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.quantized import e2m1_values

FP8_MAX, FP4_MAX = 448.0, 6.0
# format -> (values per scale, bits per code)
FORMATS = {"fp8_pow2_32": (32, 8), "fp4_e4m3_16": (16, 4), "fp4_pow2_32": (32, 4)}


def row_bytes(fmt: str, dim: int) -> int:
    """Bytes one row of ``dim`` values takes in ``fmt``."""
    block, bits = FORMATS[fmt]
    return dim * bits // 8 + dim // block


def fits(fmt: str, dim: int) -> bool:
    """Whether rows of ``dim`` values can take ``fmt`` (the fake-quant functions leave rows
    whose width is not a multiple of the block alone)."""
    return dim % FORMATS[fmt][0] == 0


@dataclass
class PackedRows:
    """A cache pool in a trained-precision format: ``data`` [rows, row_bytes] uint8."""

    data: torch.Tensor
    fmt: str
    dtype: torch.dtype  # what reads decode to

    @property
    def dim(self) -> int:
        """Values per row, from the row's bytes: a compiled step marks the pool's width static,
        so this is a constant there (an int field would be traced as a symbol)."""
        block, bits = FORMATS[self.fmt]
        return self.data.shape[-1] // (block * bits // 8 + 1) * block

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.dim)

    @property
    def device(self) -> torch.device:
        return self.data.device


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even code as
    hardware casts do. The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so each
    range is ``round`` (half to even) at its own step; an even code is an even multiple of the
    step there. Pure arithmetic: no constant table is copied to the device inside a step."""
    mag = x.abs().clamp(max=FP4_MAX)
    fine = torch.round(mag * 2) / 2
    mid = torch.round(mag)
    coarse = torch.round(mag / 2) * 2
    value = torch.where(mag < 2, fine, torch.where(mag < 4, mid, coarse))
    return torch.copysign(value, x)


def block_pow2_scale(blocks: torch.Tensor, qmax: float, floor: float = 1e-4) -> torch.Tensor:
    """Per-block power-of-two (ue8m0) scale of ``blocks`` [..., n, block]: the smallest s
    with amax / s <= qmax, amax clamped at ``floor`` first (1e-4, as the reference does)."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=floor) / qmax)))


def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes of e2m1 values (bit 3 the sign, -0 kept)."""
    mag = q.abs()
    index = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    return index.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)


def encode(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    """``raw`` [N, dim] values *before* fake-quant -> [N, row_bytes(fmt, dim)] uint8 holding
    the codes and scales the fake-quant function computes for them (the same arithmetic:
    ``models/layers/fake_quant.py`` calls ``round_e2m1`` and ``block_pow2_scale`` here), so
    ``decode`` gives exactly its output."""
    block, _ = FORMATS[fmt]
    n, dim = raw.shape
    g = raw.float().view(n, dim // block, block)
    if fmt == "fp8_pow2_32":
        scale = block_pow2_scale(g, FP8_MAX)
        codes = (g / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(n, dim)
        return torch.cat([codes, scale.to(torch.float8_e8m0fnu).view(torch.uint8).view(n, -1)], dim=1)
    if fmt == "fp4_e4m3_16":
        amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2**-9)
        stored = (amax / FP4_MAX).to(torch.float8_e4m3fn)
        scale, scale_bytes = stored.float(), stored.view(torch.uint8)
    else:
        scale = block_pow2_scale(g, FP4_MAX)
        scale_bytes = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    four = _e2m1_codes(round_e2m1(g / scale)).view(n, dim)
    codes = four[:, 0::2] | (four[:, 1::2] << 4)
    return torch.cat([codes, scale_bytes.view(n, -1)], dim=1)


def decode(fmt: str, data: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``data`` [..., row_bytes] -> values [..., dim] in ``dtype``."""
    block, bits = FORMATS[fmt]
    lead = data.shape[:-1]
    code_bytes = dim * bits // 8
    codes, scales = data[..., :code_bytes], data[..., code_bytes:]
    if fmt == "fp8_pow2_32":
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
        scale = scales.contiguous().view(torch.float8_e8m0fnu).float()
    else:
        low, high = e2m1_values(codes & 0xF), e2m1_values(codes >> 4)
        values = torch.stack([low, high], dim=-1).reshape(*lead, dim)
        kind = torch.float8_e4m3fn if fmt == "fp4_e4m3_16" else torch.float8_e8m0fnu
        scale = scales.contiguous().view(kind).float()
    out = values.view(*lead, dim // block, block) * scale.unsqueeze(-1)
    return out.view(*lead, dim).to(dtype)


def packed_zeros(fmt: str, rows: int, dim: int, dtype: torch.dtype, device, zeros) -> PackedRows:
    """A zeroed pool of ``rows`` rows (``zeros`` allocates, as the plain pools do). Zero bytes
    decode to zeros in every format."""
    if not fits(fmt, dim):
        raise ValueError(f"rows of {dim} values cannot take {fmt} (blocks of {FORMATS[fmt][0]})")
    return PackedRows(zeros(rows, row_bytes(fmt, dim), dtype=torch.uint8, device=device), fmt, dtype)
