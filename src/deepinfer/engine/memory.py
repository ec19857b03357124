"""How many bytes a model's weights and its KV cache take: what a loaded engine holds
(``LLM.memory_report``) and what a model would need before anything is loaded (``plan``,
``deepinfer plan``: the model is built on the meta device from its config alone).

Cache bytes come from the layers' ``LayerCacheSpec`` through ``CacheLayout`` (the engine's own
block geometry), so the plan and the engine count the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.pools import CacheLayout, check_pool_dtype
from deepinfer.weights.writer import stored_format

GIB = 1 << 30


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the parameters and buffers by dtype name, each storage once (the
    experts' views into their stacked tensors, tied weights)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + storage.nbytes()
    return out


def cache_tensors(pools: list[Any]) -> list[torch.Tensor]:
    """Every cache tensor in ``pools`` (``LayerPools``, nested ``CompressorPools`` and packed
    rows), each once (V4.1's layers share entries)."""
    found: dict[int, torch.Tensor] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(obj.data_ptr(), obj)
        elif is_dataclass(obj):
            for f in fields(obj):
                visit(getattr(obj, f.name))

    for layer in pools:
        visit(layer)
    return list(found.values())


def pool_bytes(pools: list[Any]) -> int:
    """Bytes of the cache tensors in ``pools`` (``cache_tensors``)."""
    return sum(t.untyped_storage().nbytes() for t in cache_tensors(pools))


def layer_kind(spec: LayerCacheSpec) -> str:
    """A name for what a layer keeps per token."""
    if not spec.window and not spec.ratio:
        return "full attention"
    if not spec.ratio:
        return f"window {spec.window}"
    shared = " (reads another layer's entries)" if spec.shared_from is not None else ""
    return f"window {spec.window} + 1/{spec.ratio} compressed{shared}"


def kv_bytes_per_token(layout: CacheLayout, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Per layer kind: how many layers; the cache bytes each token adds to one layer as the
    sequence grows (its compressed entries' and indexer keys' share and the overlap
    snapshots, plus its window K=V row unless the window is bounded); and, with a bounded
    window, the fixed window bytes one sequence holds in one layer."""
    out: dict[str, dict[str, float]] = {}
    for spec in layout.specs:
        one = CacheLayout(
            (spec,), layout.block_size, layout.window, layout.ratios, layout.bounded_window, layout.packed_kv
        )
        kind = out.setdefault(
            layer_kind(spec),
            {"layers": 0, "bytes_per_token_per_layer": 0.0, "window_bytes_per_sequence_per_layer": 0},
        )
        kind["layers"] += 1
        kind["bytes_per_token_per_layer"] = one.block_bytes(dtype) / layout.block_size
        kind["window_bytes_per_sequence_per_layer"] = (
            one.window_blocks_per_sequence() * one.window_block_bytes(dtype) if layout.bounded_window else 0
        )
    return out


@dataclass
class MemoryPlan:
    """What a model needs per device at a context length (``plan``)."""

    model: str
    max_model_len: int
    tensor_parallel_size: int
    weight_bytes_per_device: int
    weight_bytes_by_format: dict[str, int]
    kv_bytes_per_token: float  # all layers, what each token adds
    kv_window_bytes_per_sequence: int  # all layers, the bounded window one sequence holds
    kv_bytes_per_sequence: int  # at max_model_len: tokens, window and compressor slot
    kv_by_layer_kind: dict[str, dict[str, float]]
    memory_bytes: int | None = None  # per device
    usable_bytes: int | None = None  # memory x utilization
    sequences_that_fit: int | None = None
    longest_context_that_fits: int | None = None  # one sequence, capped at the model's limit
    cache_tokens_that_fit: int | None = None  # the cache left after the weights, in tokens
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BYTES = {"bf16": 2, "fp32": 4}


def planned_weight_bytes(model: nn.Module, quantization: dict[str, Any] | None, tp: int) -> dict[str, int]:
    """Resident bytes per device by storage format for a meta-device ``model`` whose
    checkpoint has ``quantization`` (the release format: fp8 blocks, fp4 experts, fp8 Engram
    rows) or none (bf16), split over ``tp`` devices: tensors of two or more dimensions are
    sharded (column/row-parallel linears, experts across devices, vocab-parallel embedding
    and head), one-dimensional ones and the routers are replicated."""
    block = tuple((quantization or {}).get("weight_block_size") or (128, 128))
    fp32_markers = getattr(model, "fp32_param_markers", ())
    keeps_fp32 = getattr(model, "keeps_fp32", lambda name: any(m in name for m in fp32_markers))
    state = model.state_dict(keep_vars=True)
    out: dict[str, int] = {}
    for name, t in state.items():
        if t is None:
            continue
        fmt = (
            stored_format(name, t, fp32_markers)
            if quantization
            else ("int" if not t.is_floating_point() else "bf16")
        )
        if fmt == "bf16" and keeps_fp32(name):
            fmt = "fp32"
        n = t.numel()
        if fmt == "fp4":  # two values a byte, one ue8m0 scale per 32
            size = n // 2 + n // 32
        elif fmt == "fp8_rows":  # Engram rows: one scale per 32
            size = n + n // 32
        elif fmt == "fp8":
            size = n + math.ceil(t.shape[0] / block[0]) * math.ceil(t.shape[1] / block[1])
        elif fmt == "int":
            size = n * t.element_size()
        else:
            size = n * _BYTES[fmt]
        sharded = t.dim() >= 2 and not name.endswith("gate.weight")
        out[fmt] = out.get(fmt, 0) + (math.ceil(size / tp) if sharded else size)
    return out


def plan(
    model: nn.Module,
    quantization: dict[str, Any] | None,
    max_model_len: int,
    *,
    name: str = "",
    tensor_parallel_size: int = 1,
    memory_bytes: int | None = None,
    utilization: float = 0.9,
    block_size: int = 16,
    kv_dtype: torch.dtype = torch.bfloat16,
    bounded_window: bool = True,
    packed_kv: bool = True,
) -> MemoryPlan:
    """Weights and KV cache per device for ``model`` (built on the meta device) at
    ``max_model_len`` tokens; with ``memory_bytes`` per device, how many such sequences fit
    and the longest context one sequence can have. ``packed_kv``: the engine's
    ``kv_cache_dtype="auto"`` (rows the model writes in a trained-precision format stored in
    it), with ``kv_dtype`` for the rest."""
    tp = tensor_parallel_size
    weights = planned_weight_bytes(model, quantization, tp)
    layout = CacheLayout.from_specs(
        model.cache_spec(), block_size, bounded_window=bounded_window, packed_kv=packed_kv
    )
    check_pool_dtype(layout, kv_dtype)
    per_token = layout.block_bytes(kv_dtype) / layout.block_size
    window = layout.window_blocks_per_sequence() * layout.window_block_bytes(kv_dtype)
    slot = layout.slot_bytes(kv_dtype) + window  # what a sequence holds whatever its length
    blocks = math.ceil(max_model_len / layout.block_size)
    per_sequence = blocks * layout.block_bytes(kv_dtype) + slot
    result = MemoryPlan(
        model=name,
        max_model_len=max_model_len,
        tensor_parallel_size=tp,
        weight_bytes_per_device=sum(weights.values()),
        weight_bytes_by_format=weights,
        kv_bytes_per_token=per_token,
        kv_window_bytes_per_sequence=window,
        kv_bytes_per_sequence=per_sequence,
        kv_by_layer_kind=kv_bytes_per_token(layout, kv_dtype),
        assumptions=[
            f"weights as the checkpoint stores them ({'fp8 blocks, fp4 experts' if quantization else 'bf16'}), "
            "kept resident; fp32 where the model keeps fp32",
            f"tensor parallel {tp}: tensors of 2+ dims split evenly, 1-dim tensors and routers replicated",
            f"KV cache in {str(kv_dtype).removeprefix('torch.')}"
            + (" (rows with a trained-precision format packed in it)" if packed_kv else "")
            + f", paged in blocks of {layout.block_size} tokens; "
            + (
                f"each sequence holds {layout.window_blocks_per_sequence()} window block(s) per layer "
                f"(window {layout.window})"
                if layout.bounded_window
                else "every layer keeps each token's window K=V row"
            )
            + "; the single K=V head is replicated on every tensor-parallel device",
        ],
    )
    if memory_bytes is not None:
        usable = int(memory_bytes * utilization)
        free = usable - result.weight_bytes_per_device
        result.memory_bytes, result.usable_bytes = memory_bytes, usable
        result.sequences_that_fit = max(0, free // per_sequence)
        fit_blocks = max(0, (free - slot) // layout.block_bytes(kv_dtype))
        longest = int(fit_blocks * layout.block_size)
        cap = getattr(model.config, "max_position_embeddings", longest)
        result.longest_context_that_fits = min(longest, cap)
        result.cache_tokens_that_fit = longest
        result.assumptions.append(
            f"usable memory: {utilization:.0%} of {memory_bytes / GIB:.1f} GiB per device (activations "
            "and the rest stay outside)"
        )
    return result


def format_plan(p: MemoryPlan) -> str:
    """The plan as a short report."""
    lines = [
        f"model: {p.model}  (max_model_len {p.max_model_len:,}, tensor parallel {p.tensor_parallel_size})",
        f"weights per device: {p.weight_bytes_per_device / GIB:,.2f} GiB  ("
        + ", ".join(f"{k} {v / GIB:,.2f} GiB" for k, v in sorted(p.weight_bytes_by_format.items()))
        + ")",
        f"KV cache per token: {p.kv_bytes_per_token / 1024:,.2f} KiB, plus a bounded window of "
        f"{p.kv_window_bytes_per_sequence / 2**20:,.2f} MiB per sequence; per sequence at "
        f"{p.max_model_len:,} tokens: {p.kv_bytes_per_sequence / GIB:,.2f} GiB",
    ]
    for kind, v in p.kv_by_layer_kind.items():
        window = v["window_bytes_per_sequence_per_layer"]
        lines.append(
            f"  {int(v['layers'])} x {kind}: {v['bytes_per_token_per_layer']:,.1f} B per token per layer"
            + (f", window {window / 1024:,.0f} KiB per sequence per layer" if window else "")
        )
    if p.memory_bytes is not None:
        lines.append(
            f"per device {p.memory_bytes / GIB:,.1f} GiB, usable {p.usable_bytes / GIB:,.1f} GiB: "
            f"{p.sequences_that_fit:,} sequence(s) of {p.max_model_len:,} tokens fit; "
            f"longest context for one sequence: {p.longest_context_that_fits:,} tokens "
            f"(the cache holds {p.cache_tokens_that_fit:,} tokens)"
        )
    lines += [f"assumes: {a}" for a in p.assumptions]
    return "\n".join(lines)


def kv_cache_report(
    layout: CacheLayout,
    dtype: torch.dtype,
    pool_tensors: list[Any],
    block_pools: list[Any],
    window_pools: list[Any] | None,
    data_parallel_size: int,
) -> dict[str, Any]:
    """An engine's KV cache: bytes allocated (every pool tensor; on the CPU pages are touched
    as blocks fill) and in use (blocks some request holds), and what a token costs per layer
    kind. ``block_pools``: one per data-parallel rank (every rank has pools of this size);
    blocks in use are summed over them."""
    block = layout.block_bytes(dtype)
    in_use = sum(1 for pool in block_pools for refs in pool.ref_count if refs > 0)
    window: dict[str, int] = {}
    if window_pools:
        window_block = layout.window_block_bytes(dtype)
        window_in_use = sum(1 for pool in window_pools for refs in pool.ref_count if refs > 0)
        window = {
            "window_blocks": window_pools[0].num_blocks,
            "window_block_bytes": window_block,
            "window_blocks_in_use": window_in_use,
            "window_in_use_bytes": window_in_use * window_block,
        }
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "allocated_bytes": pool_bytes(pool_tensors),
        "block_size": layout.block_size,
        "block_bytes": block,
        "blocks": block_pools[0].num_blocks,
        "blocks_in_use": in_use,
        "in_use_bytes": in_use * block + window.get("window_in_use_bytes", 0),
        "slot_bytes": layout.slot_bytes(dtype),
        "bytes_per_token": block / layout.block_size,
        "by_layer_kind": kv_bytes_per_token(layout, dtype),
        "bounded_window": layout.bounded_window,
        "data_parallel_size": data_parallel_size,
        **window,
    }


def engine_kv_cache_report(engine: Any) -> dict[str, Any]:
    """``kv_cache_report`` of an ``Engine``'s cache: its pools' tensors and blocks."""
    pools, windows = engine.block_pools, engine.window_block_pools
    dp = engine.config.data_parallel_size
    return kv_cache_report(engine.layout, engine.kv_dtype, engine.runner.pools, pools, windows, dp)
