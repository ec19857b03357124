"""The explicit cache argument of the model (DESIGN.md §2: no module-level mutable state).

This is the simple contiguous per-sequence cache: every row of a batch shares the same
start position. The paged cache of the engine core replaces it behind the same
``ForwardBatch`` argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """A compressor's running state: the incomplete trailing group, the previous window's
    overlap half (CSA only), and every compressed entry emitted so far."""

    buffer_kv: torch.Tensor | None = None
    buffer_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    emitted: int = 0


@dataclass
class LayerCache:
    """One layer's cache: the last ``window - 1`` K=V vectors plus compressor states."""

    window: torch.Tensor | None = None
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


@dataclass
class SequenceCache:
    """Per-layer caches of a batch of sequences that advance in lockstep."""

    layers: list[LayerCache]
    num_tokens: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> SequenceCache:
        return cls(layers=[LayerCache() for _ in range(num_layers)])


@dataclass
class ForwardBatch:
    """Everything besides token ids and positions that one forward step reads or writes."""

    cache: SequenceCache
    last_logits_only: bool = False
