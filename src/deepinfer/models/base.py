"""What every model class gives the engine, the loader and research code."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.session import one_shot_logits
from deepinfer.models.layers.moe import MoE


class CausalLM(nn.Module):
    """Two ways in, shared by every architecture.

    ``model(input_ids [B, S])``: every row is a sequence starting at position 0; returns fp32
    logits [B, S, V] (a throwaway cache is made; research code needs nothing else).

    ``model(input_ids [T], positions [T], batch)``: one engine step over a flat batch of tokens
    from many sequences; returns what ``step`` returns.

    The class also declares, with defaults, every hook the checkpoint loader calls
    (``deepinfer.weights.loader.LoadableModel``) and the draft layers speculative decoding
    may run (``draft_model``), so neither probes the model with ``hasattr``.
    """

    # -- loader hooks ----------------------------------------------------------------------
    # Parameter names containing one of these stay fp32 whatever the compute dtype.
    fp32_param_markers: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors this model may leave unused without a word (e.g. draft layers the
    # config does not ask for).
    ignored_checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors skipped with one warning (a vision tower of a text-only port).
    skipped_checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    skipped_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ()
    # Layers the model builds but can serve without when a checkpoint lacks all of them.
    optional_checkpoint_prefix: ClassVar[str | None] = None

    def keeps_fp32(self, name: str) -> bool:
        """Whether the loaded tensor ``name`` stays fp32."""
        return any(m in name for m in self.fp32_param_markers)

    def keeps_stored(self, name: str) -> bool:
        """Whether an fp8 tensor ``name`` is handed over as stored (with its scale) through
        ``keep_stored`` instead of being dequantised on load."""
        return False

    def keep_stored(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Adopt the stored fp8 ``weight`` and its ``scale`` (see ``keeps_stored``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no tensor as stored ({name})")

    def drop_optional_layers(self) -> None:
        """The checkpoint has none of ``optional_checkpoint_prefix``: serve without them."""
        raise NotImplementedError(f"{type(self).__name__} has no optional layers")

    def allocate_stacked_experts(self, dtype: torch.dtype, device: torch.device) -> None:
        """Before loading: give every MoE layer its stacked expert tensors, so experts load
        straight into them (no second copy)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.allocate_stacked_experts(dtype, device)

    def post_load(self, path: Path) -> None:
        """After loading the weights of the checkpoint at ``path`` (fusions, tokenizer-bound
        tables)."""

    # -- speculative decoding --------------------------------------------------------------

    def draft_model(self, method: str) -> Any | None:
        """The draft layers of this checkpoint for speculative ``method`` ("mtp", "dspark"),
        wrapped with what they share of the target (embedding, head); None when it has none."""
        return None

    # -- engine interface ------------------------------------------------------------------

    # V4.1's causal encoder/decoder prefill: the first decoder layer (None: no such split,
    # ``ced_prefill`` is refused).
    ced_split: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def step_tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per-device tensors the step reads that are neither parameters nor buffers (RoPE
        tables); ``torch.compile`` marks them static so a new device copy recompiles nothing."""
        return []

    def cache_spec(self) -> list[LayerCacheSpec]:
        raise NotImplementedError

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One engine step: fp32 logits [N, V] for ``batch.logits_idx`` (every row when None);
        with ``batch.feature_idx`` set, ``(logits, features [F, ...])``, the hidden states a
        model drafter reads for those rows."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if batch is None:
            return one_shot_logits(self, input_ids)
        if input_ids.dim() != 1 or positions is None or positions.shape != input_ids.shape:
            raise ValueError("with a ForwardBatch, input_ids and positions must both be flat [T] tensors")
        return self.step(input_ids, positions, batch)
