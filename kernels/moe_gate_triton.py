"""The MoE router after its projection as one launch on CUDA: ``deepinfer::moe_gate``.

From the router logits the plain form makes some ten small launches per layer: the scoring
function (softplus and sqrt, softmax or sigmoid), the bias add and top-k (or the hash table's
lookup), the gather of the chosen scores, their normalisation and scale. Here one program per
token does all of it in registers; the projection stays one cuBLAS product.

The plain forms here (``scores``, ``weigh``, ``reference``) are the model's definitions, which
CPU steps, compiled steps, autograd, routing replay and ``batch_invariant`` run, and the op's
default implementation. The kernel rounds to the logits' dtype wherever the plain form does.
Its top-k takes the lowest expert among equal biased scores (``Tensor.topk`` leaves ties
unspecified) and lists the choices best first. The kernel is defined at the first CUDA call,
so CPU-only machines never import Triton; it also runs under ``TRITON_INTERPRET=1`` on CPU
tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from deepinfer.kernels.triton_support import triton_installed

SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
# Most experts (padded to a power of two) and choices one program holds.
MAX_EXPERTS = 1024
MAX_TOP_K = 32


def scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Routing scores of logits [N, E], in the logits' dtype."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    return logits.sigmoid()


def weigh(scores: torch.Tensor, ids: torch.Tensor, normalize: bool, scale: float) -> torch.Tensor:
    """The chosen experts' scores, normalised to sum 1 if ``normalize``, times ``scale``."""
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k], ids [N, k])``: experts from ``table[input_ids]`` (hash routing) or
    the top-k of scores + ``bias``."""
    s = scores(logits, scoring)
    if table is not None:
        assert input_ids is not None
        ids = table[input_ids.reshape(-1)].long()
    else:
        biased = s if bias is None else s + bias
        ids = torch.topk(biased, top_k, dim=-1, sorted=False).indices
    return weigh(s, ids, normalize, scale), ids


@torch.library.custom_op("deepinfer::moe_gate", mutates_args=())
def moe_gate(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int64)."""
    weights, ids = reference(logits, bias, table, input_ids, top_k, scoring, normalize, scale)
    return weights.contiguous(), ids.contiguous()


@moe_gate.register_fake
def _(logits, bias, table, input_ids, top_k, scoring, normalize, scale):
    k = table.shape[-1] if table is not None else top_k
    n = logits.shape[0]
    return logits.new_empty((n, k)), logits.new_empty((n, k), dtype=torch.long)


def takes(
    logits: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None, top_k: int, scoring: str
) -> bool:
    """Float logits [N, E] with E up to ``MAX_EXPERTS``, k up to ``MAX_TOP_K``, a known
    scoring function, an fp32 bias (and Triton installed)."""
    k = table.shape[-1] if table is not None else top_k
    return (
        triton_installed()
        and logits.dim() == 2
        and logits.is_floating_point()
        and 0 < logits.shape[1] <= MAX_EXPERTS
        and 0 < k <= min(MAX_TOP_K, logits.shape[1])
        and scoring in SCORING
        and (bias is None or bias.dtype == torch.float32)
    )


@moe_gate.register_kernel("cuda")
def _cuda(logits, bias, table, input_ids, top_k, scoring, normalize, scale):
    if takes(logits, bias, table, top_k, scoring):
        return moe_gate_triton(logits, bias, table, input_ids, top_k, scoring, normalize, scale)
    weights, ids = reference(logits, bias, table, input_ids, top_k, scoring, normalize, scale)
    return weights.contiguous(), ids.contiguous()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_gate(
        logits_ptr,
        bias_ptr,
        table_ptr,
        ids_in_ptr,
        weights_ptr,
        ids_ptr,
        experts,
        k,
        table_width,
        scale,
        SCORING: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HASHED: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        ok_e = e < experts
        dtype = weights_ptr.dtype.element_ty
        x = tl.load(logits_ptr + t * experts + e, mask=ok_e, other=0.0).to(tl.float32)
        # each plain-form op computes in fp32 and rounds to the logits' dtype
        if SCORING == 0:
            y = tl.exp(tl.minimum(x, 20.0))
            # log1p(y): the series where 1 + y would drop y's digits
            series = y * (1.0 - y * (0.5 - y * (1.0 / 3.0 - 0.25 * y)))
            soft = tl.where(x > 20.0, x, tl.where(y < 1e-2, series, tl.log(1.0 + y)))
            s = tl.sqrt(soft.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        elif SCORING == 1:
            x = tl.where(ok_e, x, float("-inf"))
            ex = tl.exp(x - tl.max(x, axis=0))
            s = (ex / tl.sum(ex, axis=0)).to(dtype).to(tl.float32)
        else:
            s = tl.sigmoid(x).to(dtype).to(tl.float32)
        kk = tl.arange(0, BLOCK_K)
        ok_k = kk < k
        if HASHED:
            token = tl.load(ids_in_ptr + t)
            ids = tl.load(table_ptr + token * table_width + kk, mask=ok_k, other=0).to(tl.int64)
            hit = ids[:, None] == e[None, :]
            w = tl.sum(tl.where(hit, s[None, :], 0.0), axis=1)
        else:
            biased = s
            if HAS_BIAS:
                biased = s + tl.load(bias_ptr + e, mask=ok_e, other=0.0)
            biased = tl.where(ok_e, biased, float("-inf"))
            ids = tl.zeros([BLOCK_K], dtype=tl.int64)
            w = tl.zeros([BLOCK_K], dtype=tl.float32)
            for r in range(0, k):
                best = tl.max(biased, axis=0)
                pick = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)
                ids = tl.where(kk == r, pick.to(tl.int64), ids)
                w = tl.where(kk == r, tl.sum(tl.where(e == pick, s, 0.0), axis=0), w)
                biased = tl.where(e == pick, float("-inf"), biased)
        w = tl.where(ok_k, w, 0.0)
        if NORMALIZE:
            total = tl.sum(w, axis=0).to(dtype).to(tl.float32)
            denom = (total + 1e-20).to(dtype).to(tl.float32)
            w = (w / denom).to(dtype).to(tl.float32)
        tl.store(weights_ptr + t * k + kk, (w * scale).to(dtype), mask=ok_k)
        tl.store(ids_ptr + t * k + kk, ids, mask=ok_k)

    return _moe_gate


def moe_gate_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``deepinfer::moe_gate``: one program per token."""
    import triton

    n, experts = logits.shape
    k = table.shape[-1] if table is not None else top_k
    rows = logits.contiguous()
    weights = rows.new_empty((n, k))
    ids = rows.new_empty((n, k), dtype=torch.long)
    if n:
        hashed = table is not None
        if hashed:
            assert input_ids is not None
        _kernel()[(n,)](
            rows,
            rows if bias is None else bias.contiguous(),
            table.contiguous() if hashed else rows,
            input_ids.reshape(-1).contiguous() if hashed else rows,
            weights,
            ids,
            experts,
            k,
            k if hashed else 0,
            scale,
            SCORING=SCORING.index(scoring),
            HAS_BIAS=bias is not None,
            HASHED=hashed,
            NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(experts),
            BLOCK_K=triton.next_power_of_2(k),
        )
    return weights, ids
