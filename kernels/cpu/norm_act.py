"""RMSNorm (with the residual add before it) and SwiGLU as one CPU call each, for decode.

At a few rows per step the residual add, the seven ATen calls of an fp32-statistics RMSNorm
and the chunk/SiLU/multiply of SwiGLU cost microseconds of dispatch each for nanoseconds of
arithmetic; a B=1 Llama step runs about twenty of them per layer (and in fp32 prefill the
separate SiLU and multiply passes were a visible share of the step). These kernels do the
same math in one pass per call: the sum in the activations' dtype, statistics and the weight
product in fp32, one rounding back, as ``RMSNorm`` does; SiLU as ``x / (1 + exp(-x))``, in
fp32 on ATen's vectors (a scalar ``std::exp`` loop was measurably slower).
Sums run in another order than ATen's reductions, so results agree to fp32 rounding, not
bitwise. fp32 inputs of more than ``MAX_ROWS`` rows are split by rows across ATen's threads. Built once
per machine by ``build``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# decode-sized inputs, run on one thread: the decode stack's rows (the per-layer path must run
# the same kernels); fp32 inputs of more rows (prefill) are split across ATen's threads, bf16
# ones stay on ATen's kernels (their scalar loops here are not vectorised)
MAX_ROWS = 64


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("norm_act.cpp"))
    if lib is not None:
        for name in _NAMES.values():
            build.bind(
                lib, f"add_rms_norm_{name}", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
            )
            build.bind(lib, f"silu_mul_{name}", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    return lib


def supports(x: torch.Tensor) -> bool:
    """A 2-D CPU activation without autograd in a dtype the kernels have: fp32 of any row
    count, bf16 up to ``MAX_ROWS``."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and (x.shape[0] <= MAX_ROWS or x.dtype == torch.float32)
        and x.dtype in _NAMES
        and not x.requires_grad
        and not batch_invariant.active()
        and library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(res, norm)`` with ``res = x + delta`` (``x`` itself when ``delta`` is None) and
    ``norm = RMSNorm(res)`` in ``x``'s dtype; ``weight`` [d] is read in fp32."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    rows, d = x.shape
    w = weight.float().contiguous()
    out = torch.empty_like(x)
    if delta is None:
        res, dptr = x, None
    else:
        delta = delta.to(x.dtype).contiguous()
        res, dptr = torch.empty_like(x), delta.data_ptr()
    getattr(lib, f"add_rms_norm_{_NAMES[x.dtype]}")(
        x.data_ptr(), dptr, w.data_ptr(), res.data_ptr(), out.data_ptr(), rows, d, eps
    )
    return res, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 I] = [gate | up]; returns [rows, I]."""
    lib = library()
    assert lib is not None
    gu = gate_up.contiguous()
    rows, width = gu.shape
    out = torch.empty(rows, width // 2, dtype=gu.dtype)
    getattr(lib, f"silu_mul_{_NAMES[gu.dtype]}")(gu.data_ptr(), out.data_ptr(), rows, width // 2)
    return out
