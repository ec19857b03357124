"""What every model class gives the engine and research code."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.session import one_shot_logits


class CausalLM(nn.Module):
    """Two ways in, shared by every architecture.

    ``model(input_ids [B, S])``: every row is a sequence starting at position 0; returns fp32
    logits [B, S, V] (a throwaway cache is made; research code needs nothing else).

    ``model(input_ids [T], positions [T], batch)``: one engine step over a flat batch of tokens
    from many sequences; returns fp32 logits [N, V] for ``batch.logits_idx``.
    """

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def cache_spec(self) -> list[LayerCacheSpec]:
        raise NotImplementedError

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        if batch is None:
            return one_shot_logits(self, input_ids)
        if input_ids.dim() != 1 or positions is None or positions.shape != input_ids.shape:
            raise ValueError("with a ForwardBatch, input_ids and positions must both be flat [T] tensors")
        return self.step(input_ids, positions, batch)
