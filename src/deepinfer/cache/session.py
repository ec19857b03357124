"""A stateful cache for a fixed group of sequences that advance in lockstep.

Research code and tests use it to run a model chunk by chunk (``Session.feed``) without the
scheduler; ``model(input_ids)`` uses it for its throwaway cache. Blocks are laid out
statically: sequence i owns blocks ``[i * n, (i + 1) * n)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_metadata import SeqChunk, build_forward_batch

DEFAULT_BLOCK_SIZE = 16


class Session:
    def __init__(self, model: nn.Module, batch_size: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE):
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
        logits = self.model(input_ids.reshape(-1).to(self.device), positions, batch)
        self.num_tokens += s
        return logits.view(b, len(offsets), -1)


def one_shot_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits [B, S, V] for rows that all start at position 0."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    return Session(model, input_ids.shape[0], input_ids.shape[1]).feed(input_ids)
