"""The lightning indexer's entry choice as one CPU kernel (V4 variant).

A query scores each visible compressed entry ``j`` by ``sum_h w_h * ReLU(q_h . k_j) * scale`` and
keeps the ``topk`` best, ties to the older entry (``models/layers/topk.py``). ``reference`` is
that in plain PyTorch: it gathers every entry a row may see, [T, E, D], multiplies it with
every head, [T, H, E], then masks, and under ``torch.compile`` Inductor reduces each
(token, head, entry) dot product to a scalar with a horizontal sum, for every entry up to the
batch's longest row. On the tiny V4's offline benchmark the kernel Inductor made of it (with
the layer's attention fused in) was the compiled step's largest in a ``perf`` profile
(benchmarks/RESULTS.md).

The C++ kernel reads the key rows straight from the pool, only for entries a row may see,
transposes ``V`` of them at a time (one vector of entries) and accumulates every head's
product over the head dimension as a vector of ``V`` entries: no horizontal sums and no work
for a row's padded entries. The rows of one sequence's prefill chunk see the same entries, so
a transposed block is kept for the next row, which widens the kernel's lead over the einsum
form on prefill steps. It then picks the ``topk`` with the same rule (a partial sort by
score, then column). Each row's arithmetic depends only on that row, so a token's choice
does not depend on the batch around it; its sums run in another order than ``reference``'s,
so scores differ in the last bits (the tests compare exactly on inputs whose sums are exact).

``deepinfer::indexer_topk`` is the Python custom op (the ``ctypes`` build on fp32 CPU
tensors, else ``reference``); ``kernels/cpu/step_ops.py`` registers its C++ twin for compiled
steps, built from the same source (``kernels/cpu/indexer_topk.cpp``)."""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build

# Rows * entries * heads * dim from which the kernel runs on every thread (below, one).
THREADED_WORK = 1 << 16


def scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[T, E]: each row's score of each of its entries (the model's formula), -inf where the
    entry is not visible; what ``reference`` and the kernel rank."""
    t, e = entry_idx.shape
    keys_e = keys.index_select(0, entry_idx.reshape(-1)).view(t, e, keys.shape[-1])  # [T, E, D]
    per_head = torch.einsum("thd,ted->the", q.float(), keys_e.float()).relu() * scale
    index_scores = (per_head * weights.float().unsqueeze(-1)).sum(dim=1)  # [T, E]
    return index_scores.masked_fill(~entry_valid, float("-inf"))


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen entries' pool rows and visibility, [T, topk], in plain PyTorch: the model's
    formula, then a stable descending sort (ties: the lower column); a row of fewer than
    ``topk`` entries is padded with its first entry (pool row 0 without any), not visible."""
    t, e = entry_idx.shape
    index_scores = scores(q, keys, entry_idx, entry_valid, weights, scale)
    _, order = torch.sort(index_scores, dim=-1, descending=True, stable=True)
    picks = order[:, : min(topk, e)]
    rows, valid = entry_idx.gather(1, picks), entry_valid.gather(1, picks)
    if e < topk:  # the same columns, then padding no row sees
        pad = entry_idx[:, :1] if e else entry_idx.new_zeros(t, 1)
        rows = torch.cat([rows, pad.expand(t, topk - e)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(t, topk - e)], dim=1)
    return rows, valid


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("indexer_topk.cpp"))
    if lib is not None:
        fn = build.bind(
            lib,
            "indexer_topk_f32",
            [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int],
        )
        fn.restype = ctypes.c_int64
    return lib


def takes(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the C++ kernel runs these inputs (fp32 on the CPU, no autograd)."""
    return not batch_invariant.active() and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
        for t in (q, keys, weights)
    )


def _cpp(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = q.shape
    e = entry_idx.shape[1]
    q, keys, weights = q.contiguous(), keys.contiguous(), weights.contiguous()
    entry_idx, entry_valid = entry_idx.long().contiguous(), entry_valid.bool().contiguous()
    rows = torch.empty(t, topk, dtype=torch.long)
    valid = torch.empty(t, topk, dtype=torch.bool)
    if t == 0 or topk == 0:
        return rows, valid
    threads = torch.get_num_threads() if t * e * h * d >= THREADED_WORK else 1
    bad = lib.indexer_topk_f32(
        q.data_ptr(),
        keys.data_ptr(),
        entry_idx.data_ptr(),
        entry_valid.data_ptr(),
        weights.data_ptr(),
        rows.data_ptr(),
        valid.data_ptr(),
        t,
        h,
        d,
        e,
        keys.shape[0],
        topk,
        scale,
        threads,
    )
    if bad:
        raise IndexError(
            f"indexer_topk: {bad} visible entries index outside the key pool of {keys.shape[0]} rows"
        )
    return rows, valid


@torch.library.custom_op("deepinfer::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (roped), keys [N, D] (the index-key pool), entry_idx / entry_valid [T, E],
    weights [T, H] (per-head, already scaled) -> the chosen entries' pool rows and visibility,
    [T, topk]. A row with fewer visible entries than ``topk`` fills up with its first invisible
    columns (visibility False), as a stable sort of -inf scores would; with fewer than ``topk``
    entries (E < topk) the last columns repeat its first entry, not visible. So the width is
    ``topk`` whatever E is, and a compiled step traced at E >= topk also serves E < topk."""
    # opaque to torch.compile: the C++ kernel on fp32 CPU tensors, else the reference
    lib = library() if takes(q, keys, weights) else None
    if lib is not None:
        return _cpp(lib, q, keys, entry_idx, entry_valid, weights, topk, scale)
    rows, picked = reference(q, keys, entry_idx, entry_valid, weights, topk, scale)
    return rows.contiguous(), picked.contiguous()  # the fake's layout


@indexer_topk.register_fake
def _(q, keys, entry_idx, entry_valid, weights, topk, scale):
    shape = (entry_idx.shape[0], topk)  # no min(topk, E): a step's width never specialises
    return entry_idx.new_empty(shape, dtype=torch.long), entry_valid.new_empty(shape, dtype=torch.bool)
