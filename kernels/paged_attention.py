"""Paged causal attention for full-attention models (Llama): ``deepinfer::paged_attention``.

One op over a whole flat step: single-token decode rows attend to their gathered pages in one
batched SDPA; each multi-token prefill chunk attends causally to every cached position of its
sequence plus its own tokens. The chunk loop depends on the step's layout, which a tracer
would turn into one graph per layout, so the op is opaque to ``torch.compile`` and the
layout travels as tensors (``span_meta``). The reference implementation runs on every device;
its decode rows read the pools in place where a kernel exists: C++ on the CPU, and on CUDA
the op ``deepinfer::paged_decode_attention``, whose CUDA kernel is ``paged_decode_triton``
(each row read only up to its own length rather than the step's padded one). That choice
lives in the op's registered CUDA kernel, where the dispatcher makes it and
``compile/launch_count.py`` sees it; every other device runs the op's default, the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from deepinfer.kernels import kv_int8
from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import prefill_attention as cpu_prefill_attention


def gather_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The decode rows by gathering: every row's pool rows at all ``decode_kv`` positions
    (valid or not) copied out, then one masked SDPA, written into ``out`` [T + 1, H, d] (row
    T takes the padded rows, all-masked and so NaN, with no host sync to drop them)."""
    t = out.shape[0] - 1
    n, (_, _, d) = decode_rows.shape[0], q.shape
    n_kv = kv_int8.values_per_row(k_pool) // d
    decode_rows = torch.where(decode_rows >= 0, decode_rows, t)
    keys = kv_int8.read(k_pool[decode_kv], q.dtype).view(n, -1, n_kv, d)
    vals = kv_int8.read(v_pool[decode_kv], q.dtype).view(n, -1, n_kv, d)
    o = F.scaled_dot_product_attention(
        q[decode_rows.clamp(max=t - 1)].unsqueeze(2),  # [n, H, 1, d]
        keys.transpose(1, 2),  # [n, kv, L, d]
        vals.transpose(1, 2),
        attn_mask=decode_valid[:, None, None, :],
        enable_gqa=True,
    )
    out[decode_rows] = o.squeeze(2)


@torch.library.custom_op("deepinfer::paged_decode_attention", mutates_args=("out",))
def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The decode rows of ``paged_attention`` written into ``out`` [T + 1, H, d] (contiguous);
    by default ``gather_decode_attention``."""
    gather_decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out)


@paged_decode_attention.register_kernel("cuda")
def _decode_cuda(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out) -> None:
    # imported at the first CUDA call: CPU-only machines never import Triton
    from deepinfer.kernels import paged_decode_triton

    if paged_decode_triton.takes(q, k_pool, v_pool):
        paged_decode_triton.decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out)
    else:
        gather_decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this call (custom ops have no backward: plain PyTorch then)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    span_meta: torch.Tensor,
    span_kv_rows: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, d]; pools [rows, kv_heads * d] (int8 pools: ``kv_int8`` rows); decode_rows [Nd], decode_kv/decode_valid
    [Nd, L] (pool rows of each decode token's positions and which are real); span_meta [S, 4]
    = (first token row, tokens, first position, offset into span_kv_rows) per prefill chunk,
    span_kv_rows the pool rows of positions 0 .. end-1 of each chunk, concatenated.
    Padding (``StepPadding``): decode rows of -1 and spans of 0 tokens are skipped.
    ``span_meta`` is a CPU tensor (the host loops over it; a decode-only step, the kind a CUDA
    graph captures, has only padding spans and the decode path never syncs with the host).
    Returns [T, H, d] in q's dtype (rows no span or decode covers are zero). Plain,
    differentiable PyTorch (the research path calls it directly: custom ops have no backward);
    on the CPU without autograd the decode rows run ``cpu_attention`` and the spans
    ``cpu_prefill_attention``, which read the pool rows in place instead of gathering them;
    elsewhere the decode rows run ``deepinfer::paged_decode_attention`` (CUDA: the Triton
    kernel, which reads each row's positions only up to its length)."""
    t, h, d = q.shape
    n_kv = kv_int8.values_per_row(k_pool) // d
    out = q.new_zeros(t + 1, h, d)  # row t takes padded decode rows (no host sync to drop them)
    n = decode_rows.shape[0]
    decode_in_place = n and cpu_attention.supports(q, k_pool, v_pool)
    spans_in_place = bool(span_meta.shape[0]) and cpu_prefill_attention.supports(q, k_pool, v_pool)
    if decode_in_place or spans_in_place:  # CPU: pages read in place
        dense = out if out.dtype == torch.float32 else torch.zeros(t + 1, h, d)
        if decode_in_place:
            cpu_attention.decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, dense)
        if spans_in_place:
            cpu_prefill_attention.prefill_attention(q, k_pool, v_pool, span_meta, span_kv_rows, dense)
        if dense is not out:
            out.copy_(dense)
    if n and not decode_in_place:
        if _needs_autograd(q, k_pool, v_pool):
            gather_decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out)
        else:  # the dispatcher picks the device's kernel (CUDA: Triton)
            paged_decode_attention(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, out)
    for first, count, start, offset in [] if spans_in_place else span_meta.tolist():  # a CPU tensor
        if count == 0:
            continue
        end = start + count
        rows = span_kv_rows[offset : offset + end]
        keys = kv_int8.read(k_pool.index_select(0, rows), q.dtype).view(end, n_kv, d)
        vals = kv_int8.read(v_pool.index_select(0, rows), q.dtype).view(end, n_kv, d)
        causal = torch.arange(end, device=q.device) <= (
            start + torch.arange(count, device=q.device)
        ).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            q[first : first + count].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            vals.transpose(0, 1).unsqueeze(0),
            attn_mask=causal,
            enable_gqa=True,
        )
        out[first : first + count] = o[0].transpose(0, 1)
    return out[:t]


# The op (opaque to ``torch.compile``); its default kernel is the reference itself.
paged_attention = torch.library.custom_op("deepinfer::paged_attention", mutates_args=())(
    paged_attention_reference
)


@paged_attention.register_fake
def _(q, k_pool, v_pool, decode_rows, decode_kv, decode_valid, span_meta, span_kv_rows):
    return torch.empty_like(q)


def _prefix_attention(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """Each of ``q``'s rows [n, H, d] over its keys and values [n, L, kv, d], of which positions
    0 .. ``last`` [n] are its own: the scores' maximum is exact in any order, and the
    softmax's sums run through ``cumsum`` over positions, so a row's result depends on its own
    positions alone, never on how many rows or padded positions share the call."""
    n, h, d = q.shape
    group = h // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)  # [n, L, H, d]
    vals = vals.repeat_interleave(group, dim=2)
    scores = (q.unsqueeze(1) * keys).sum(-1) * d**-0.5  # [n, L, H]
    own = torch.arange(keys.shape[1], device=q.device) <= last.unsqueeze(1)
    scores = scores.masked_fill(~own.unsqueeze(-1), float("-inf"))
    weights = (scores - scores.amax(1, keepdim=True)).exp()
    rows = torch.arange(n, device=q.device)
    total = weights.cumsum(1)[rows, last]  # [n, H]
    summed = (weights.unsqueeze(-1) * vals).cumsum(1)[rows, last]  # [n, H, d]
    return (summed / total.unsqueeze(-1)).to(q.dtype)


def _prefix_rows(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``_prefix_attention``, recomputed in the backward pass when it takes part in one: its
    [rows, positions, heads, head_dim] intermediates would otherwise stay saved for every layer
    (a training forward over a batch of rollouts)."""
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or vals.requires_grad):
        return torch.utils.checkpoint.checkpoint(_prefix_attention, q, keys, vals, last, use_reentrant=False)
    return _prefix_attention(q, keys, vals, last)


def paged_attention_invariant(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    span_meta: torch.Tensor,
    span_kv_rows: torch.Tensor,
) -> torch.Tensor:
    """``paged_attention_reference``'s result by a formula whose every row is the same whether
    it is a decode row, a row of a prefill chunk of any size, or a row of the research
    forward's whole sequence (``batch_invariant``: the engine's logprobs are then a training
    forward's bitwise). Differentiable; memory grows with rows x positions, so it suits the
    short sequences of RL rollouts rather than long prefills."""
    t, h, d = q.shape
    n_kv = kv_int8.values_per_row(k_pool) // d
    out = q.new_zeros(t + 1, h, d)
    n = decode_rows.shape[0]
    if n:
        rows = torch.where(decode_rows >= 0, decode_rows, t)
        keys = kv_int8.read(k_pool[decode_kv], q.dtype).view(n, -1, n_kv, d)
        vals = kv_int8.read(v_pool[decode_kv], q.dtype).view(n, -1, n_kv, d)
        last = (decode_valid.long().sum(1) - 1).clamp(min=0)
        out = out.index_copy(0, rows, _prefix_rows(q[rows.clamp(max=t - 1)], keys, vals, last))
    for first, count, start, offset in span_meta.tolist():
        if count == 0:
            continue
        end = start + count
        kv_rows = span_kv_rows[offset : offset + end]
        keys = kv_int8.read(k_pool.index_select(0, kv_rows), q.dtype).view(1, end, n_kv, d)
        vals = kv_int8.read(v_pool.index_select(0, kv_rows), q.dtype).view(1, end, n_kv, d)
        last = start + torch.arange(count, device=q.device)
        part = _prefix_rows(
            q[first : first + count], keys.expand(count, -1, -1, -1), vals.expand(count, -1, -1, -1), last
        )
        out = out.index_copy(0, torch.arange(first, first + count, device=q.device), part)
    return out[:t]
