"""Caches for running a model outside the engine.

``Session``: a stateful cache for a fixed group of sequences that advance in lockstep;
research code and tests run a model chunk by chunk with it (``Session.feed``) without the
scheduler. Blocks are laid out statically: sequence i owns blocks ``[i * n, (i + 1) * n)``.

``research_batch``: the binding behind ``model(input_ids, attention_mask)``: every row is a
sequence starting at position 0 (its real tokens only, so left or right padding changes
nothing), all run as one step over fresh pools written out of place (``ForwardBatch.functional``),
with the layers' inputs and outputs on the ``[B, S, ...]`` grid.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from deepinfer.cache.forward_batch import ForwardBatch, Grid
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk
from deepinfer.cache.step_metadata import build_forward_batch

DEFAULT_BLOCK_SIZE = 16


class SteppableModel(Protocol):
    """What a cache binding needs of a model (every ``CausalLM``)."""

    @property
    def compute_dtype(self) -> torch.dtype: ...

    def cache_spec(self) -> list[LayerCacheSpec]: ...

    def parameters(self): ...

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch): ...


class Session:
    """A persistent paged cache for ``batch_size`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self, model: SteppableModel, batch_size: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE
    ):
        self.model = model
        self.layout = CacheLayout.from_specs(model.cache_spec(), block_size)
        param = next(model.parameters())
        self.device = param.device
        blocks_per_seq = math.ceil(max_len / self.layout.block_size)
        self.max_len = blocks_per_seq * self.layout.block_size
        self.pools = allocate_pools(
            self.layout, batch_size * blocks_per_seq, batch_size, model.compute_dtype, self.device
        )
        self.tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)]
        self.num_tokens = 0

    def feed(
        self, input_ids: torch.Tensor, replay_from: int = 0, last_logits_only: bool = False
    ) -> torch.Tensor:
        """Append ``input_ids`` [B, S] to every sequence; return fp32 logits [B, S, V] (or
        [B, 1, V] with ``last_logits_only``). ``replay_from`` > 0 runs V4.1's causal
        encoder/decoder prefill: positions before it skip the decoder layers."""
        b, s = input_ids.shape
        if b != len(self.tables):
            raise ValueError(f"this session holds {len(self.tables)} sequences, got a batch of {b}")
        if self.num_tokens + s > self.max_len:
            raise ValueError(f"session capacity is {self.max_len} tokens; {self.num_tokens + s} requested")
        offsets = [s - 1] if last_logits_only else list(range(s))
        chunks = [
            SeqChunk(table, slot, self.num_tokens, s, logits_offsets=offsets, replay_from=replay_from)
            for slot, table in enumerate(self.tables)
        ]
        positions, batch = build_forward_batch(self.layout, self.pools, chunks, self.device)
        logits = self.model.step(input_ids.reshape(-1).to(self.device), positions, batch)
        self.num_tokens += s
        return logits.view(b, len(offsets), -1)


def token_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[int, int]]:
    """Each row's (first column, length) of real tokens; clear errors for bad inputs."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    b, s = input_ids.shape
    if attention_mask is None:
        return [(0, s)] * b
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, s):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
        raise ValueError(f"attention_mask must be a tensor shaped like input_ids {(b, s)}, got {shape}")
    mask = attention_mask.detach().to("cpu")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    spans = []
    for i, row in enumerate(mask.long().tolist()):
        ones = [j for j, m in enumerate(row) if m]
        if ones and ones[-1] - ones[0] + 1 != len(ones):
            raise ValueError(
                f"attention_mask row {i} marks tokens that are not contiguous; pad on the left or the right"
            )
        spans.append((ones[0], len(ones)) if ones else (0, 0))
    if not any(n for _, n in spans):
        raise ValueError("attention_mask marks no token in any row")
    return spans


def research_batch(
    model: SteppableModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """(flat token ids [T], positions [T], batch) for one step over every row's real tokens,
    each row a sequence from position 0, with logits for every token."""
    spans = token_spans(input_ids, attention_mask)
    b, s = input_ids.shape
    device = next(model.parameters()).device
    layout = CacheLayout.from_specs(model.cache_spec(), DEFAULT_BLOCK_SIZE)
    bs = layout.block_size
    chunks, cells, next_block = [], [], 0
    for i, (first, n) in enumerate(spans):
        if not n:
            continue
        blocks = math.ceil(n / bs)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        chunks.append(SeqChunk(table, i, 0, n, logits_offsets=list(range(n))))
        cells += range(i * s + first, i * s + first + n)
    pools = allocate_pools(layout, next_block, b, model.compute_dtype, device)
    positions, batch = build_forward_batch(layout, pools, chunks, device)
    padded = len(cells) < b * s
    rows = torch.tensor(cells, dtype=torch.long, device=device) if padded else None
    batch.functional = True
    batch.grid = Grid(b, s, rows)
    flat = input_ids.to(device).reshape(-1)
    return (flat[rows] if rows is not None else flat), positions, batch
