"""Tensor parallelism for the Llama family: each rank keeps 1/T of every layer's heads and
of its MLP, and the two row-parallel outputs (``o_proj``, ``down_proj``) are summed across
the ranks with one all-reduce each. The norms stay whole on every rank; every rank ends with
the same logits and rank 0 samples from its own.

The embedding and the head are split by vocabulary rows: each rank looks up the tokens it
holds (the others' rows count zero) and one all-reduce sums them; each rank computes its
columns of the logits and one all-gather puts them side by side.

The split follows the usual column/row scheme: q/k/v and gate/up are split by output rows
(whole heads, whole K/V heads), o_proj and down_proj by input columns; a bias of a
row-parallel projection is kept on rank 0 only, so the sum adds it once. The model's config
becomes the rank's local shape (its heads, K/V heads and MLP width), which is what its
cache spec and kernels then see.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn


def _rows(t: torch.Tensor | None, rank: int, size: int) -> torch.Tensor | None:
    if t is None:
        return None
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n].clone()


def _columns(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[1] // size
    return t[:, rank * n : (rank + 1) * n].clone()


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]
    if linear.bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)


def check_divisible(config, size: int) -> None:
    """Tensor parallel ``size`` must split heads, K/V heads, the MLP width and the vocabulary
    evenly."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {name}={value}")


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place on a contiguous copy)."""
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_columns(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The ranks' ``x`` [..., n] side by side [..., size * n], in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def shard_llama(model: nn.Module, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Keep rank ``rank``'s share of a loaded ``LlamaForCausalLM`` (in place)."""
    cfg = model.config
    check_divisible(cfg, size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _set(linear, _rows(linear.weight.detach(), rank, size), _rows(linear.bias, rank, size))
        for linear in (attn.o_proj, mlp.down_proj):
            bias = None
            if linear.bias is not None:
                bias = linear.bias.detach().clone() if rank == 0 else torch.zeros_like(linear.bias)
            _set(linear, _columns(linear.weight.detach(), rank, size), bias)
        attn.n_heads //= size
        attn.n_kv //= size
        for projection in (attn.qkv, attn.out, mlp.gate_up, mlp.down):
            projection.fuse()  # this rank's share as one weight; no quantized or packed form
        attn.qkv.split = mlp.gate_up.split = ("out", rank, size)
        attn.out.split = mlp.down.split = ("in", rank, size)
        layer.reduce = functools.partial(all_reduce_sum, group=group)
    # vocab parallel: this rank's rows of the embedding (and of an untied head)
    vocab = cfg.vocab_size // size
    embed = model.model.embed_tokens
    embed.weight = nn.Parameter(_rows(embed.weight.detach(), rank, size), requires_grad=False)
    if not cfg.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(
            _rows(model.lm_head.weight.detach(), rank, size), requires_grad=False
        )
    model.vocab_parallel = (
        rank * vocab,
        functools.partial(all_reduce_sum, group=group),
        functools.partial(all_gather_columns, group=group),
    )
    model.config = dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=cfg.num_key_value_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )
    model.head.fuse()  # the head's share runs as it is


def _slice_linear(linear: nn.Module, rows: slice | None = None, cols: slice | None = None) -> nn.Module:
    """A bias-free linear (float or ``Fp8BlockLinear``) cut to ``rows`` x ``cols`` of its
    weight; an fp8 one keeps whole scale blocks (the cut must fall on block edges)."""
    rows, cols = rows or slice(None), cols or slice(None)
    if isinstance(linear, nn.Linear):
        weight = linear.weight.detach()[rows, cols].clone()
        out = nn.Linear(
            weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
        )
        out.weight = nn.Parameter(weight, requires_grad=False)
        return out
    from deepinfer.models.layers.quantized_linear import Fp8BlockLinear

    if not isinstance(linear, Fp8BlockLinear):
        raise ValueError(f"tensor parallel cannot split a {type(linear).__name__}")
    bn, bk = linear.block
    r = range(linear.out_features)[rows]
    c = range(linear.in_features)[cols]
    if r.start % bn or len(r) % bn or c.start % bk or len(c) % bk:
        raise ValueError(
            f"tensor parallel cut of an fp8 linear does not fall on its {linear.block} scale blocks"
        )
    scale = linear.scale[r.start // bn : (r.start + len(r)) // bn, c.start // bk : (c.start + len(c)) // bk]
    return Fp8BlockLinear(linear.weight.detach()[rows, cols].clone(), scale.clone(), linear.block)


def shard_latent_attention(
    attn: nn.Module, rank: int, size: int, group: dist.ProcessGroup | None = None
) -> None:
    """V4/V4.1 attention: rank ``rank`` keeps 1/size of the query heads (their ``wq_b`` rows
    and sinks) and of the output groups (their ``wo_a`` rows, ``wo_b`` columns); the one
    shared K=V head, the compressor and the indexer stay whole; ``wo_b``'s partial outputs
    are summed over the ranks."""
    heads, groups, d, r = attn.n_heads, attn.o_groups, attn.head_dim, attn.o_rank
    if heads % size or groups % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {heads} heads and {groups} output groups"
        )
    h, g = heads // size, groups // size
    attn.wq_b = _slice_linear(attn.wq_b, rows=slice(rank * h * d, (rank + 1) * h * d))
    attn.wo_a = _slice_linear(attn.wo_a, rows=slice(rank * g * r, (rank + 1) * g * r))
    attn.wo_b = _slice_linear(attn.wo_b, cols=slice(rank * g * r, (rank + 1) * g * r))
    attn.attn_sink = nn.Parameter(
        attn.attn_sink.detach()[rank * h : (rank + 1) * h].clone(), requires_grad=False
    )
    attn.n_heads, attn.o_groups = h, g
    attn.reduce = functools.partial(all_reduce_sum, group=group)


def shard_deepseek(model: nn.Module, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Tensor-parallel attention in every V4/V4.1 attention layer (draft layers included)."""
    from deepinfer.models.layers.attention import LatentAttention

    layers = [m for m in model.modules() if isinstance(m, LatentAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no latent attention to split")
    for attn in layers:
        shard_latent_attention(attn, rank, size, group)
