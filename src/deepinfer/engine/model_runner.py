"""Model runner: turns scheduled chunks into one flat batch, runs the model, returns logits.

It owns the physical cache pools and knows tensors, never policy (DESIGN.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.paged_cache import CacheLayout, SeqChunk, allocate_pools, build_forward_batch
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.models.forward_batch import ForwardBatch


@dataclass
class PreparedStep:
    """A step's tensors, built before its input token values are all known (async)."""

    chunks: list[ScheduledChunk]
    positions: torch.Tensor
    batch: ForwardBatch
    sample_rows: list[int]  # row of the returned logits for each sampling chunk (-1: none)
    prompt_rows: list[tuple[int, int]]  # (first row, count) of prompt-logprob logits per chunk


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        layout: CacheLayout,
        num_blocks: int,
        num_slots: int,
        device: torch.device,
        ced_replay: int | None = None,
        compile_model: bool = False,
    ) -> None:
        """``ced_replay``: with CED prefill, how many trailing prompt tokens run the decoder.
        ``compile_model``: run the step through ``torch.compile`` (``deepinfer.compilation``)."""
        self.model = model
        self.ced_replay = ced_replay
        self.forward = model.step
        if compile_model:
            from deepinfer.compilation import compile_step

            self.forward = compile_step(model)
        self.layout = layout
        self.device = device
        dtype = model.compute_dtype
        self.pools = allocate_pools(layout, num_blocks, num_slots, dtype, device)

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedStep:
        seq_chunks, sample_rows, prompt_rows = [], [], []
        row = 0
        for c in chunks:
            req = c.request
            offsets: list[int] = []
            prompt_len = len(req.prompt_token_ids)
            if req.params.prompt_logprobs is not None and c.start < prompt_len - 1:
                # logits at positions p predict token p + 1 of the prompt
                offsets = list(range(min(c.num_tokens, prompt_len - 1 - c.start)))
            prompt_rows.append((row, len(offsets)))
            if c.samples:
                if not offsets or offsets[-1] != c.num_tokens - 1:
                    offsets.append(c.num_tokens - 1)
                sample_rows.append(row + len(offsets) - 1)
            else:
                sample_rows.append(-1)
            row += len(offsets)
            replay_from = 0
            if self.ced_replay is not None and req.params.prompt_logprobs is None:
                replay_from = max(0, prompt_len - self.ced_replay)  # prompt logprobs need every row
            seq_chunks.append(
                SeqChunk(
                    req.block_ids, req.slot, c.start, c.num_tokens, c.restore_overlap, offsets, replay_from
                )
            )
        positions, batch = build_forward_batch(self.layout, self.pools, seq_chunks, self.device)
        return PreparedStep(chunks, positions, batch, sample_rows, prompt_rows)

    def input_ids(self, step: PreparedStep) -> torch.Tensor:
        """Token ids of the step; read at launch time so async steps see fresh tokens."""
        ids: list[int] = []
        for c in step.chunks:
            ids += c.request.all_token_ids[c.start : c.end]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, step: PreparedStep, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids, step.positions, step.batch)
