"""Routed experts of a MoE step as one CPU call (fp32), for decode sizes and small experts
(whole prefill steps of tiny ones).

At a few tokens per step the sorted dispatch of ``moe.routed_experts_reference`` (argsort,
bincount, a gather, three ``F.linear`` per active expert, ``index_add_``) costs far more in
dispatch than the arithmetic itself on a small model. Two kernels, each giving a token's
result in a fixed order that depends only on its own row (so the same whatever it is batched
with, within the kernel's row range), each summing a token's choices in choice order:

- ``routed_experts_dot``: each (token, choice) pair's SwiGLU expert as dot products against the
  expert's weight rows; any expert size, up to ``MAX_ROWS`` tokens.
- ``routed_experts_transposed``: each pair as rows times the experts' transposed weights, one
  vector FMA over the output columns per input element (no horizontal sums), blocks of output
  columns accumulated in registers, the pairs grouped by expert so each weight load serves
  up to eight tokens; experts up to ``SMALL_EXPERT_BYTES`` per matrix (kept
  as transposed copies), up to a token count that falls as the matrices grow
  (``transposed_rows``).

Sums run in another order than the GEMMs', so results agree with the reference to fp32
rounding, not bitwise. Built once per machine by ``build``; callers keep the reference
where it is missing."""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build

# Tokens per call up to which the per-pair dot products beat the sorted GEMM dispatch.
MAX_ROWS = 16
# Expert matrices up to SMALL_EXPERT_BYTES run the transposed kernel, up to a token count
# that falls as the matrices grow: the sorted dispatch's GEMMs pay a fixed cost per active
# expert and then run faster per token. Where the transposed kernel stops winning (8 experts,
# top-2, AVX-512; benchmarks/RESULTS.md): 64 x 64 and 128 x 128 (64 KiB) matrices stay ahead at
# 8,192 tokens; 256 x 512 (512 KiB) up to ~128 tokens; 512 x 512 (1 MiB) falls behind from 64.
SMALL_EXPERT_BYTES = 1 << 20
MAX_ROWS_SMALL_EXPERTS = 32
TINY_EXPERT_BYTES = 64 << 10
MAX_ROWS_TINY_EXPERTS = 4096

# Transposed copies of small stacked experts, keyed by the stacked tensors' addresses, shapes
# and versions (an in-place write makes a new copy); a handful of models' worth at most.
_TRANSPOSED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TRANSPOSED_LIMIT = 64


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("moe.cpp"))
    if lib is not None:
        build.bind(
            lib,
            "routed_experts_f32",
            [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int],
        )
        build.bind(
            lib,
            "routed_experts_small_f32",
            [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int],
        )
    return lib


def transposed_rows(w1: torch.Tensor) -> int:
    """Tokens up to which the transposed kernel (from transposed copies made once,
    ``_transposed``) beats the sorted dispatch for these experts; 0: experts too large for it."""
    nbytes = w1[0].numel() * w1.element_size()
    if nbytes <= TINY_EXPERT_BYTES:
        return MAX_ROWS_TINY_EXPERTS
    return MAX_ROWS_SMALL_EXPERTS if nbytes <= SMALL_EXPERT_BYTES else 0


def supports(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """fp32 CPU tokens, decode-sized or with small experts, and contiguous fp32 stacked
    experts, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= max(MAX_ROWS, transposed_rows(w1))
        and x.dtype == torch.float32
        and all(w.dtype == torch.float32 and w.is_contiguous() and w.dim() == 3 for w in (w1, w2, w3))
        and not x.requires_grad
        and not batch_invariant.active()
        and library() is not None
    )


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The ``deepinfer::routed_experts`` contract (kernels/moe.py) for ``supports`` inputs:
    small experts through the transposed kernel, others through the per-pair dot products."""
    if x.shape[0] <= transposed_rows(w1):
        return routed_experts_transposed(x, weights, ids, w1, w2, w3, limit)
    return routed_experts_dot(x, weights, ids, w1, w2, w3, limit)


def _launch(
    name: str,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    inter: int,
    limit: float,
    *tensors: torch.Tensor,
) -> torch.Tensor:
    """Run kernel ``name`` on (x, weights, ids, *tensors, out): the argument order both share."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    weights, ids = weights.to(torch.float32).contiguous(), ids.to(torch.int64).contiguous()
    (n_tok, d), k = x.shape, ids.shape[1]
    out = torch.empty_like(x)
    threads = torch.get_num_threads() if n_tok * k * inter * d >= 1 << 17 else 1
    pointers = [t.data_ptr() for t in (x, weights, ids, *tensors, out)]
    getattr(lib, name)(*pointers, n_tok, k, d, inter, limit, threads)
    return out


def routed_experts_transposed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Each pair as rows times the experts' transposed weights (copies made once)."""
    return _launch("routed_experts_small_f32", x, weights, ids, w1.shape[1], limit, *_transposed(w1, w2, w3))


def routed_experts_dot(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Each pair as dot products against the experts' own weight rows (decode sizes)."""
    scratch = torch.empty(x.shape[0] * ids.shape[1], 3 * w1.shape[1])  # gate | up, then activations
    return _launch("routed_experts_f32", x, weights, ids, w1.shape[1], limit, w1, w2, w3, scratch)


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter (inference tensors have none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _transposed(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13t [E, d, 2I] = gate | up columns, w2t [E, I, d]) for the transposed kernel. Cached
    per stacked tensor and version; an entry goes when its ``w1`` is collected, so a new tensor
    at a freed one's address never finds a stale copy."""
    key = tuple((id(w), w.data_ptr(), tuple(w.shape), _version(w)) for w in (w1, w2, w3))
    found = _TRANSPOSED.get(key)
    if found is None:
        if len(_TRANSPOSED) >= _TRANSPOSED_LIMIT:
            _TRANSPOSED.clear()
        w13t = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous()
        found = _TRANSPOSED[key] = (w13t, w2.transpose(1, 2).contiguous())
        weakref.finalize(w1, _TRANSPOSED.pop, key, None)
    return found
