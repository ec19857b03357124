"""The explicit cache argument of the model: no module-level mutable state
(docs/architecture.md, 'The cache').

A step runs a flat batch of T tokens from any number of sequences (decodes and prefill
chunks mixed). Everything the layers need to find their cache rows is precomputed here as
index tensors by the model runner, so the layers do only gathers, math and scatters:

- window K=V vectors are paged per token (``window_idx`` reads the last ``window`` positions
  of each token's sequence, ``window_write`` stores this step's vectors);
- compressed entries and indexer keys are paged, ``block_size // ratio`` per block;
- compressor partial groups and the CSA overlap half live in per-sequence slots; a snapshot
  of the overlap is kept with every full block so a prefix-cache hit restores it exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.cache import kv_dtypes
from deepinfer.cache.kv_formats import PackedRows, encode


@dataclass
class CompressorPools:
    """Physical state of one compressor (a layer's main one, or its indexer's)."""

    buf_kv: torch.Tensor  # [slots * ratio, width]  the incomplete trailing group
    buf_gate: torch.Tensor
    ovl_kv: torch.Tensor | None = None  # [slots * ratio, width]  last complete group (CSA)
    ovl_gate: torch.Tensor | None = None
    snap_kv: torch.Tensor | None = None  # [blocks * ratio, width]  overlap at each block end
    snap_gate: torch.Tensor | None = None


@dataclass
class LayerPools:
    """Physical cache tensors of one layer."""

    window: torch.Tensor | PackedRows  # [blocks * block_size, D]  (K for dense models)
    values: torch.Tensor | None = None  # [blocks * block_size, D]  V when stored apart from K
    entries: torch.Tensor | PackedRows | None = None  # [blocks * block_size / ratio, D]
    index_keys: torch.Tensor | PackedRows | None = None  # [blocks * block_size / ratio, index_dim]
    # (entries and index_keys alias another layer's tensors under V4.1's KV sharing)
    compressor: CompressorPools | None = None
    indexer: CompressorPools | None = None
    token_ids: torch.Tensor | None = None  # [blocks * block_size] int64 per-token ids


@dataclass
class GroupMeta:
    """Compressor bookkeeping for one ratio: which rows form each group closed this step.

    Rows are numbered in a "source" = cat(chunk rows [T], buffer rows [src_buf_rows],
    overlap rows [src_ovl_rows]).
    """

    src_buf_rows: torch.Tensor  # [K1] rows of the buffer pool read this step
    src_ovl_rows: torch.Tensor  # [K2] rows of the overlap pool read this step
    group_rows: torch.Tensor  # [G, r] source rows of each closed group
    prev_rows: torch.Tensor  # [G, r] source rows of the previous group (-1: none)
    group_pos: torch.Tensor  # [G] absolute position of each group's first token
    entry_slot: torch.Tensor  # [G] row of the entry pool receiving each group's entry
    buf_src: torch.Tensor  # chunk rows that start/extend a trailing partial group ...
    buf_dst: torch.Tensor  # ... and their buffer-pool rows
    ovl_src: torch.Tensor  # source rows of each sequence's new last complete group ...
    ovl_dst: torch.Tensor  # ... and their overlap-pool rows
    snap_src: torch.Tensor  # source rows of groups that end a block ...
    snap_dst: torch.Tensor  # ... and their snapshot rows
    restore_src: torch.Tensor  # snapshot rows to restore into a slot (prefix-cache hit) ...
    restore_dst: torch.Tensor  # ... and the overlap-pool rows they go to
    entry_idx: torch.Tensor  # [T, E] entry-pool rows each token may see (clamped)
    entry_valid: torch.Tensor  # [T, E] bool


@dataclass
class FullAttentionMeta:
    """Where full-attention layers read keys: per token for decodes, per chunk for prefill
    (a multi-token chunk attends densely and causally to every cached position of its
    sequence). All tensors, so a compiled step does not specialise on the step's layout."""

    decode_rows: torch.Tensor  # [Nd] token rows of single-token chunks
    # [Nd, L] pool rows of each decode token's positions (clamped), and which are valid; None
    # in the compact form a captured step is given (``expand`` makes them on the device)
    decode_kv: torch.Tensor | None
    decode_valid: torch.Tensor | None
    span_meta: torch.Tensor  # [S, 4] per prefill chunk: first row, tokens, start, kv offset (CPU)
    span_kv_rows: torch.Tensor  # pool rows of positions 0 .. end-1 of each chunk, concatenated
    # the compact form: each decode row's blocks [Nd, L / block_size] (the null block past its
    # table) and its last position [Nd] (-1: a padded row). A step padded to ``max_model_len``
    # (a graph bucket) would otherwise build and copy L entries per row on the host each step.
    decode_blocks: torch.Tensor | None = None
    decode_pos: torch.Tensor | None = None
    block_size: int = 0
    length: int = 0
    null_block: int = 0  # where positions a row does not read point (as the full form's)

    def expand(self) -> FullAttentionMeta:
        """The compact form's ``decode_kv`` and ``decode_valid``, made by device ops (inside a
        captured step, so no host work); the full form as it is."""
        if self.decode_kv is not None or self.decode_blocks is None or self.decode_pos is None:
            return self
        bs = self.block_size
        q = torch.arange(self.length, device=self.decode_pos.device)
        valid = q.unsqueeze(0) <= self.decode_pos.unsqueeze(1)
        kv = self.decode_blocks.index_select(1, q // bs) * bs + q % bs
        kv = torch.where(valid, kv, self.null_block * bs)
        return dataclasses.replace(self, decode_kv=kv, decode_valid=valid)


@dataclass(frozen=True)
class Grid:
    """The research binding's ``[B, S]`` layout of a flat step: ``rows`` are the flat indices
    (into ``B * S``) of the step's tokens, in step order; None when every grid cell is a
    token (no padding), so the two layouts are views of each other."""

    batch_size: int
    seq_len: int
    rows: torch.Tensor | None = None


@dataclass
class RoutingTrace:
    """The routed experts of one forward's MoE layers, in the order they run: each layer's
    gate hands its own choice [T, k] to ``route``, which records the choice it keeps:
    ``replay``'s [T, layers, k] where given (entries < 0: the layer's own), else its own
    (R3, routing replay: a trainer computes its loss under the rollout's routing)."""

    replay: torch.Tensor | None = None
    recorded: list[torch.Tensor] = field(default_factory=list)

    def route(self, ids: torch.Tensor) -> torch.Tensor:
        layer = len(self.recorded)
        if self.replay is not None:
            if layer >= self.replay.shape[1]:
                raise ValueError(
                    f"routed_experts: holds {self.replay.shape[1]} MoE layers, the model has more"
                )
            given = self.replay[:, layer].to(device=ids.device, dtype=ids.dtype)
            if given.shape != ids.shape:
                raise ValueError(
                    f"routed_experts: layer {layer} has {tuple(given.shape)} ids, the gate chose {tuple(ids.shape)}"
                )
            ids = torch.where(given >= 0, given, ids)
        self.recorded.append(ids)
        return ids

    def stacked(self) -> torch.Tensor:
        """[T, layers, k] of the choices kept."""
        return torch.stack(self.recorded, dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        """Take a replayed step's choices, ``stacked``'s [T, layers, k] as the captured step
        returned them."""
        self.recorded = list(rows.unbind(1))


@dataclass
class ForwardBatch:
    """Everything besides token ids and positions that one forward step reads or writes.

    Two bindings share every layer: the engine's (pools persist across steps and are written
    in place) and the research binding of ``model(input_ids)`` (``functional``: fresh pools
    for this call only, written out of place so autograd, ``functional_call`` and
    ``torch.compile`` see plain functions; layers take their inputs and give their outputs
    on the ``[B, S, ...]`` ``grid``; each layer's output is appended to ``hidden_states``).
    """

    pools: list[LayerPools]
    window_idx: torch.Tensor  # [T, W] window-pool rows (clamped; see window_valid)
    window_valid: torch.Tensor  # [T, W] bool
    window_write: torch.Tensor  # [T] window-pool row of each token
    groups: dict[int, GroupMeta] = field(default_factory=dict)  # by ratio
    full: FullAttentionMeta | None = None  # set when the model has full-attention layers
    logits_idx: torch.Tensor | None = None  # token rows whose logits are returned (None: all)
    # Speculative decoding with a model drafter: rows whose draft features (the hidden states
    # the drafter reads) the step also returns; None: the step returns logits only.
    feature_idx: torch.Tensor | None = None
    # which layers' entering hidden states those features are, for a model whose drafter
    # chooses them (a separately trained DSpark head); empty: the model's own choice
    feature_layers: tuple[int, ...] = ()
    # Causal encoder/decoder prefill (V4.1, optional): rows that run the decoder layers (None:
    # every row), and the decoder's window mask, which also hides positions before each
    # sequence's replay start (those never ran the decoder).
    decoder_rows: torch.Tensor | None = None
    decoder_window_valid: torch.Tensor | None = None
    functional: bool = False
    # research binding only: projections multiply on the engine's row-invariant kernel (with
    # the linear's gradients), so logits equal a ``batch_invariant`` engine's bitwise
    invariant: bool = False
    grid: Grid | None = None
    hidden_states: list[torch.Tensor] | None = None
    # the MoE layers' expert choices: recorded (``enable_return_routed_experts``) or replayed
    # (the research forward's ``routed_experts=``); None: neither
    routing: RoutingTrace | None = None
    # served LoRA adapters (``enable_lora``): each row's adapter slot, a
    # ``models.layers.lora.LoraStep`` (None: no adapter in the step); the executor makes it
    # current around the forward, where the projections read it
    lora: Any = None
    # a compiled step's form of the same: each row's adapter slot [T] (-1: none; padding rows
    # too), which the projections hand to ``deepinfer::lora_add``
    lora_slots: torch.Tensor | None = None

    def write(
        self,
        pool: torch.Tensor | PackedRows,
        rows: torch.Tensor,
        values: torch.Tensor,
        raw: torch.Tensor | None = None,
    ) -> torch.Tensor | PackedRows:
        """Store ``values`` at ``rows`` of ``pool``; returns the tensor to read them from (the
        pool itself, or under the functional binding a new tensor). A pool packed in a
        trained-precision format encodes ``raw``, the values before fake-quant (``values``
        is what its reads will give back)."""
        if isinstance(pool, PackedRows):
            if raw is None:
                raise ValueError(f"a {pool.fmt} pool is written from the values before fake-quant (raw=)")
            data = encode(pool.fmt, raw)
            if self.functional:
                return dataclasses.replace(pool, data=pool.data.index_copy(0, rows, data))
            pool.data.index_copy_(0, rows, data)
            return pool
        return kv_dtypes.store(pool, rows, values, functional=self.functional)

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """A flat ``[T, ...]`` tensor on the ``[B, S, ...]`` grid (pad cells zero); unchanged
        without a grid."""
        grid = self.grid
        if grid is None:
            return x
        b, s = grid.batch_size, grid.seq_len
        if grid.rows is None:
            return x.reshape(b, s, *x.shape[1:])
        cells = x.new_zeros(b * s, *x.shape[1:]).index_copy(0, grid.rows, x)
        return cells.view(b, s, *x.shape[1:])

    def to_flat(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_grid``: a ``[B, S, ...]`` tensor's token rows ``[T, ...]``;
        unchanged without a grid."""
        grid = self.grid
        if grid is None:
            return x
        cells = x.reshape(grid.batch_size * grid.seq_len, *x.shape[2:])
        return cells if grid.rows is None else cells[grid.rows]

    def record(self, x: torch.Tensor) -> None:
        """Keep one layer's output (grid layout) when the caller asked for hidden states."""
        if self.hidden_states is not None:
            self.hidden_states.append(x)

    def metadata(self) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
        """The step's index tensors (never the cache pools) in a fixed order, each with the
        dims whose size follows the step's contents. ``torch.compile`` marks those dims
        dynamic; a captured graph copies the tensors into its static inputs."""
        yield self.window_idx, (0,)
        yield self.window_valid, (0,)
        yield self.window_write, (0,)
        for t in (self.logits_idx, self.feature_idx, self.decoder_rows, self.decoder_window_valid):
            if t is not None:
                yield t, (0,)
        for ratio in sorted(self.groups):
            meta = self.groups[ratio]
            for f in dataclasses.fields(meta):
                yield getattr(meta, f.name), ((0, 1) if f.name in ("entry_idx", "entry_valid") else (0,))
        if self.full is not None:
            for f in dataclasses.fields(self.full):
                value = getattr(self.full, f.name)
                if isinstance(value, torch.Tensor):
                    yield value, ((0, 1) if f.name in ("decode_kv", "decode_valid") else (0,))

    def pool_tensors(self) -> Iterator[torch.Tensor]:
        """Every cache tensor of the step (a packed pool's bytes), each once: rows on dim 0,
        then the width the model fixes."""
        seen: set[int] = set()

        def tensors(obj) -> Iterator[torch.Tensor]:
            if isinstance(obj, PackedRows):
                obj = obj.data
            if isinstance(obj, torch.Tensor):
                if id(obj) not in seen:
                    seen.add(id(obj))
                    yield obj
            elif dataclasses.is_dataclass(obj):
                for f in dataclasses.fields(obj):
                    yield from tensors(getattr(obj, f.name))

        for layer in self.pools:
            yield from tensors(layer)

    def expanded(self) -> ForwardBatch:
        """This batch with its full-attention metadata in the full form (``expand``): a
        model's step calls it once, before its layers read ``full``."""
        if self.full is None or self.full.decode_kv is not None:
            return self
        return dataclasses.replace(self, full=self.full.expand())

    def clone_metadata(self) -> ForwardBatch:
        """A copy with new storage for every index tensor; the pools stay shared."""
        return self.map_metadata(torch.Tensor.clone)

    def map_metadata(
        self, fn: Callable[[torch.Tensor], torch.Tensor], keep_on_host: tuple[str, ...] = ()
    ) -> ForwardBatch:
        """A copy with ``fn`` applied to every index tensor (not the pools), except the
        fields named in ``keep_on_host``, which are shared as they are."""

        def mapped(obj):
            changes = {
                f.name: fn(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor) and f.name not in keep_on_host
            }
            return dataclasses.replace(obj, **changes)

        return dataclasses.replace(
            mapped(self),
            groups={r: mapped(m) for r, m in self.groups.items()},
            full=None if self.full is None else mapped(self.full),
        )

    def decoder_batch(self) -> ForwardBatch:
        """The per-token view of the decoder rows (compressor bookkeeping is left whole: the
        decoder's KV source compresses every row before the batch narrows)."""
        rows = self.decoder_rows
        assert rows is not None and self.decoder_window_valid is not None
        if self.feature_idx is not None:
            raise ValueError("draft features with CED prefill are not supported (the decoder skips rows)")
        groups = {
            r: dataclasses.replace(m, entry_idx=m.entry_idx[rows], entry_valid=m.entry_valid[rows])
            for r, m in self.groups.items()
        }
        logits_idx = self.logits_idx
        if logits_idx is not None:
            new_row = torch.full((self.window_write.shape[0],), -1, dtype=torch.long, device=rows.device)
            new_row[rows] = torch.arange(rows.shape[0], device=rows.device)
            logits_idx = new_row[logits_idx]
            if bool((logits_idx < 0).any()):
                raise ValueError("logits were requested for a row that does not run the decoder layers")
        return dataclasses.replace(
            self,
            window_idx=self.window_idx[rows],
            window_valid=self.decoder_window_valid[rows],
            window_write=self.window_write[rows],
            groups=groups,
            logits_idx=logits_idx,
            decoder_rows=None,
            decoder_window_valid=None,
        )
