"""QAT fake quantisation as one launch on CUDA: ``deepinfer::fake_quant``, with a Triton kernel.

In eager PyTorch one fake quantisation (``models/layers/fake_quant.py``) is some ten to
fifteen launches: the cast to fp32, the block amax, the scale's clamp, division, log2, ceil
and exp2 (or its e4m3 cast), the division by the scale, the rounding (fp8's cast, or e2m1's
three rounds, two comparisons and a ``copysign``), the product and the cast back. Here one
program holds ``GROUPS`` blocks in registers, takes each block's amax and scale and writes the
dequantised values.

The kernel gives the formula's bits in exact fp32 and integer steps, without ``log2`` and
``exp2`` (Triton's ``exp2`` is ``ex2.approx.ftz`` on CUDA) or fp8 conversions (absent before
sm_89):

- divisions round to nearest (``div_rn``: Triton's ``/`` is ``div.full``, approximate);
- the power-of-two scale is ``2^ceil(log2 r)`` as fp32 ``log2`` gives it: ``r = 2^e (1 + f)``
  gives ``e`` for ``f = 0``, and for ``f > 0`` ``e + 1`` unless ``e + log2(1 + f)`` rounds
  back to ``e`` in fp32 (``f`` a few ulps, ``|e| >= 4``). ``e + min(f / ln 2, 0.5)`` rounds
  to the same side, since ``f / ln 2`` and ``log2(1 + f)`` differ far less than either's
  distance from the rounding boundary at such ``f``;
- e4m3 rounds to nearest even at its 3 mantissa bits (``2^-9`` steps below ``2^-6``) and
  saturates at 448, as ``Tensor.to(torch.float8_e4m3fn)`` does;
- e2m1 rounds as ``cache/kv_formats.py``'s ``round_e2m1``: ``round`` at the step of each range.

Inputs are finite (a NaN's block is out of contract). ``models/layers/fake_quant.py`` calls
this op on eager non-CPU steps; CPU steps, compiled steps and autograd keep the plain formula,
which is also the op's default implementation. The kernel is defined at the first CUDA call,
so CPU-only machines never import Triton; it also runs under ``TRITON_INTERPRET=1`` on CPU
tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepinfer.kernels.triton_support import triton_installed

# format -> (largest code, amax floor, power-of-two scale); the e4m3-scale floor makes the
# smallest scale e4m3's smallest subnormal
FORMATS = {
    "fp8_pow2": (448.0, 1e-4, True),
    "fp4_pow2": (6.0, 1e-4, True),
    "fp4_e4m3": (6.0, 6.0 * 2**-9, False),
}
# activation dtypes the kernel takes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# widest block one program row holds (registers)
MAX_BLOCK = 256


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value, ties to the even code: ``round`` at 0.5 below 2, 1 below 4, 2 to 6."""
    mag = x.abs().clamp(max=6.0)
    fine = torch.round(mag * 2) / 2
    mid = torch.round(mag)
    coarse = torch.round(mag / 2) * 2
    return torch.copysign(torch.where(mag < 2, fine, torch.where(mag < 4, mid, coarse)), x)


def reference(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The plain formula: ``x`` [..., D] (D a multiple of ``block``) quantised per block of
    ``block`` channels to ``fmt`` and dequantised, in ``x``'s dtype."""
    qmax, floor, pow2 = FORMATS[fmt]
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = g.abs().amax(dim=-1, keepdim=True)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=floor) / qmax)))
    else:
        scale = (amax.clamp(min=floor) / qmax).to(torch.float8_e4m3fn).float()
    if fmt == "fp8_pow2":
        q = (g / scale).to(torch.float8_e4m3fn).float()
    else:
        q = round_e2m1(g / scale)
    return (q * scale).reshape(x.shape).to(x.dtype)


@torch.library.custom_op("deepinfer::fake_quant", mutates_args=())
def fake_quant(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``x`` [..., D] fake-quantised per block of ``block`` channels: ``fmt`` "fp8_pow2"
    (e4m3 codes, power-of-two scales), "fp4_pow2" (e2m1, power-of-two) or "fp4_e4m3" (e2m1,
    e4m3 scales)."""
    if fmt not in FORMATS or block <= 0 or x.shape[-1] % block:
        raise ValueError(f"fake_quant: {fmt} in blocks of {block} over a last dim of {x.shape[-1]}")
    return reference(x, fmt, block)


@fake_quant.register_fake
def _(x, fmt, block):
    return x.new_empty(x.shape)


def takes(x: torch.Tensor, fmt: str, block: int) -> bool:
    """Triton installed; a contiguous float ``x`` whose last dim holds whole blocks of a power
    of two up to ``MAX_BLOCK``."""
    if not (triton_installed() and fmt in FORMATS and x.dtype in DTYPES and x.is_contiguous()):
        return False
    pow2_block = block > 0 and block & (block - 1) == 0
    return pow2_block and block <= MAX_BLOCK and x.dim() > 0 and x.shape[-1] % block == 0


@fake_quant.register_kernel("cuda")
def _cuda(x, fmt, block) -> torch.Tensor:
    if takes(x, fmt, block):
        return fake_quant_triton(x, fmt, block)
    return reference(x, fmt, block)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Helpers are inline: the interpreter resolves a kernel's callees in its module's globals.
    @triton.jit
    def _fake_quant(
        x_ptr,
        out_ptr,
        numel,
        QMAX: tl.constexpr,
        FLOOR: tl.constexpr,
        POW2: tl.constexpr,
        FP8: tl.constexpr,
        BLOCK: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        keep = offs < numel
        raw = tl.load(x_ptr + offs, mask=keep, other=0.0)
        g = raw.to(tl.float32)
        amax = tl.max(tl.abs(g), axis=1, keep_dims=True)
        r = tl.div_rn(tl.maximum(amax, FLOOR), QMAX)
        if POW2:  # r = 2^e (1 + f), normal as r >= FLOOR / QMAX
            bits = r.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127
            f = (bits & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07  # 2^-23
            n = tl.ceil(e.to(tl.float32) + tl.minimum(f * 1.4426950408889634, 0.5)).to(tl.int32)
            scale = ((n + 127) << 23).to(tl.float32, bitcast=True)  # 2^n (n = 128: inf)
        else:  # r in e4m3: saturated, then to nearest even at steps of 2^(e - 3)
            r = tl.minimum(r, 448.0)
            e = tl.maximum(((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            y = r * ((130 - e) << 23).to(tl.float32, bitcast=True)  # times 2^(3 - e)
            k = y.to(tl.int32)
            rest = y - k.to(tl.float32)
            k += ((rest > 0.5) | ((rest == 0.5) & ((k & 1) == 1))).to(tl.int32)  # the scale's tie
            scale = k.to(tl.float32) * ((124 + e) << 23).to(tl.float32, bitcast=True)
        v = tl.div_rn(g, scale)
        if FP8:  # e4m3: saturated, steps of 2^(e - 3) with e floored at -6 (its subnormals)
            mag = tl.minimum(tl.abs(v), 448.0)
            ev = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            up = ((130 - ev) << 23).to(tl.float32, bitcast=True)
            down = ((124 + ev) << 23).to(tl.float32, bitcast=True)
        else:  # e2m1: saturated, steps of 0.5 below 2, 1 below 4, 2 up to 6
            mag = tl.minimum(tl.abs(v), 6.0)
            up = tl.where(mag < 2.0, 2.0, tl.where(mag < 4.0, 1.0, 0.5))
            down = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
        y = mag * up  # products with powers of two are exact (and Triton's / is not)
        k = y.to(tl.int32)
        rest = y - k.to(tl.float32)
        k += ((rest > 0.5) | ((rest == 0.5) & ((k & 1) == 1))).to(tl.int32)  # a value's tie
        q = k.to(tl.float32) * down
        sign = v.to(tl.int32, bitcast=True) & -2147483648  # copysign, -0 kept
        q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        tl.store(out_ptr + offs, (q * scale).to(raw.dtype), mask=keep)

    return _fake_quant


def fake_quant_triton(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Same contract as ``deepinfer::fake_quant`` (``takes`` holds): one launch."""
    import triton

    qmax, floor, pow2 = FORMATS[fmt]
    out = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return out
    groups = min(max(1, 1024 // block), triton.next_power_of_2(numel // block))
    _kernel()[(triton.cdiv(numel // block, groups),)](
        x,
        out,
        numel,
        QMAX=qmax,
        FLOOR=floor,
        POW2=pow2,
        FP8=fmt == "fp8_pow2",
        BLOCK=block,
        GROUPS=groups,
        num_warps=4 if groups * block >= 1024 else 1,
    )
    return out
