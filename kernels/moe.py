"""Routed-expert compute of a MoE layer as one custom op: ``deepinfer::routed_experts``.

Inputs are the tokens, the router's choice (expert ids and weights, ``k`` per token) and the
experts' SwiGLU weights stacked per expert. The reference implementation sorts the
(token, expert) pairs by expert so each active expert runs one matmul over a contiguous slice;
it runs on every device. Its loop depends on how many tokens each expert got, which a tracer
cannot follow, so the op is opaque to ``torch.compile``: the gate before it and the shared
expert after it stay in the compiled graph, and no graph break is left in a MoE layer.

That loop reads the counts on the host, which a CUDA graph cannot capture. CUDA and ``meta``
tensors run ``routed_experts_grouped`` instead: fixed shapes, the counts kept on the device.
On ``meta`` (no values, so no host read can run at all) this is what lets
``tests/support/capture_guard.py`` walk the path a capture records. The CPU, which never
captures, keeps the host loop and its C++ kernels, faster there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from deepinfer.kernels.cpu import moe as cpu_moe


def expert_offsets(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The end of each expert's run among the pairs sorted by expert ([E] int32), counted on
    the device: ``bincount``'s output size would need the ids' maximum on the host."""
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat_ids.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    return counts.cumsum(0, dtype=torch.int32)


def _sort_by_expert(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert id per (token, choice) pair, the pairs' order sorted by expert, their tokens'
    rows of ``x`` in that order)."""
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    return flat_ids, order, x[order // ids.shape[1]]


# a served adapter's term on one expert matrix: (expert, matrix name, rows, their tokens) -> term
ExpertTerm = Callable[[int, str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def _product(rows: torch.Tensor, w: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``rows @ w.T``, or ``w(rows)`` for a module (the research path's expert linears, which
    a wrapper such as PEFT's LoRA layer may have replaced)."""
    return F.linear(rows, w) if isinstance(w, torch.Tensor) else w(rows)


def _plus(product: torch.Tensor, term: torch.Tensor | None) -> torch.Tensor:
    return product if term is None else product + term


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's clamped SwiGLU: gate <= limit, |up| <= limit."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _combine(
    x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, k: int
) -> torch.Tensor:
    """Scatter-add the sorted pairs' expert outputs, weighted, back onto their tokens."""
    routed = out * weights.flatten()[order].unsqueeze(1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, routed)


def routed_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor | Sequence[torch.Tensor] | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    w2: torch.Tensor | Sequence[torch.Tensor] | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    w3: torch.Tensor | Sequence[torch.Tensor] | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    limit: float,
    adapter: ExpertTerm | None = None,
) -> torch.Tensor:
    """The op's contract in plain, differentiable PyTorch (sorted dispatch; runs on every
    device). The expert weights may be stacked tensors or per-expert sequences of weights or
    of linear modules (the research path passes each expert's own linears, so gradients,
    ``functional_call`` and wrappers such as PEFT's reach them). ``adapter(expert, "w1"|"w2"|"w3", rows, tokens)``: a term added to that matrix's
    product on ``rows`` (the rows of tokens ``tokens``), or None (served LoRA adapters)."""
    flat_ids, order, picked = _sort_by_expert(x, ids)
    counts = torch.bincount(flat_ids, minlength=len(w1)).tolist()
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            rows = picked[start : start + count]
            gate, up = _product(rows, w1[e]), _product(rows, w3[e])
            if adapter is None:
                outs.append(_product(_swiglu(gate, up, limit), w2[e]))
            else:
                tokens = order[start : start + count] // ids.shape[1]
                gate, up = (_plus(p, adapter(e, n, rows, tokens)) for p, n in ((gate, "w1"), (up, "w3")))
                act = _swiglu(gate, up, limit)
                outs.append(_plus(_product(act, w2[e]), adapter(e, "w2", act, tokens)))
            start += count
    if not outs:
        return torch.zeros_like(x)
    return _combine(x, torch.cat(outs), weights, order, ids.shape[1])


@torch.library.custom_op("deepinfer::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, d], weights/ids [N, k], w1/w3 [E, I, d], w2 [E, d, I] -> [N, d] in x's dtype.

    ``sum_j weights[n, j] * w2_e(silu(min(w1_e x, limit)) * clamp(w3_e x, -limit, limit))``
    with ``e = ids[n, j]``. Its default kernel is ``routed_experts_reference``; fp32 CPU steps
    that ``cpu_moe`` takes (decode sizes; small experts, tiny ones up to 4,096 tokens) run its
    kernels.
    """
    if cpu_moe.supports(x, w1, w2, w3):
        return cpu_moe.routed_experts(x, weights, ids, w1, w2, w3, limit).contiguous()
    return routed_experts_reference(x, weights, ids, w1, w2, w3, limit).contiguous()


@routed_experts.register_fake
def _(x, weights, ids, w1, w2, w3, limit):
    # contiguous whatever x's layout, as every path returns it: compiled CPU steps' C++
    # wrappers do not assert output layouts (``compilation.inductor_options``)
    return x.new_empty(x.shape)


def routed_experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The same contract with no host synchronisation, so a CUDA graph can capture it: pairs
    sorted by expert on the device, per-expert row counts as device offsets, and
    ``torch._grouped_mm`` running every expert's rows in one grouped GEMM (bf16; other dtypes
    gather each pair's expert weights and use ``bmm``, fine for small test models).
    Registered as the op's CUDA and ``meta`` kernel."""
    flat_ids, order, picked = _sort_by_expert(x, ids)
    if x.dtype == torch.bfloat16:
        offs = expert_offsets(flat_ids, w1.shape[0])

        def linear(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)

        out = linear(_swiglu(linear(picked, w1), linear(picked, w3), limit), w2)
    else:
        experts = flat_ids[order]

        def linear(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # rows [N*k, 1, in]
            return torch.bmm(rows, w[experts].transpose(1, 2))

        rows = picked.unsqueeze(1)
        out = linear(_swiglu(linear(rows, w1), linear(rows, w3), limit), w2).squeeze(1)
    return _combine(x, out, weights, order, ids.shape[1])


for _device in ("cuda", "meta"):
    routed_experts.register_kernel(_device)(routed_experts_grouped)
