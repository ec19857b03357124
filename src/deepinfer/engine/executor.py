"""How a prepared step runs, apart from what the step holds: the engine hands every step to
``Executor.run`` and gets logits (and the drafter's features) back.

The runner (``ModelRunner``) runs one forward eagerly, compiled or from a captured graph. The
executor decides how many forwards a step is and where they run: one forward on this process;
``batch_invariant`` steps chunk by chunk (each chunk sees the shapes it would alone); tensor
parallel with the step's chunks broadcast to the worker ranks first; data parallel with each
rank running its own chunks and rank 0 gathering the logits rows. It also counts the routed
experts' load for EPLB after each step and re-places the experts every interval, and sets
the rows' LoRA adapter slots around a forward.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from deepinfer.cache.host_tensors import HostCopy
from deepinfer.config import EngineConfig
from deepinfer.distributed.eplb import (
    ExpertLoadWindow,
    ExpertPlacement,
    identity_placement,
    moe_lb,
    rebalance_experts,
)
from deepinfer.distributed.workers import TensorParallelGroup, gather_rows, reduce_expert_load
from deepinfer.engine.model_runner import ModelRunner, PreparedStep
from deepinfer.engine.routed_experts import RoutedExpertsRecorder
from deepinfer.kernels.batch_invariant import invariant_products
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.lora import running_step

logger = logging.getLogger("deepinfer")

StepResult = tuple[torch.Tensor, torch.Tensor | None]  # logits rows, the drafter's features


class StepOutput(NamedTuple):
    """What one step's forward hands the step processor."""

    logits: torch.Tensor  # the rows ``PreparedStep.sample_rows`` and ``prompt_rows`` name
    features: torch.Tensor | None = None  # the drafter's features (``feature_rows``)
    forward_s: float | None = None  # the forward's wall time, where it is its cost (CPU)
    tokens: torch.Tensor | None = None  # tokens sampled on the device (``DeviceSampling``)
    host_tokens: HostCopy | None = None  # their copy to the host, queued after them
    host_logits: HostCopy | None = None  # the logits rows logprobs read, copied beside them


class Executor:
    """Runs prepared steps over the runner and, when there are several, the worker ranks."""

    def __init__(
        self,
        runner: ModelRunner,
        model: CausalLM,
        config: EngineConfig,
        tp: TensorParallelGroup | None,
    ) -> None:
        self.runner = runner
        self.model = model
        self.config = config
        self.tp = tp
        self.data_parallel = config.data_parallel_size > 1
        # EPLB: rank 0 counts each expert's tokens (under data parallel the ranks' counts are
        # reduced into it) and the experts are re-placed every eplb_step_interval steps
        self.eplb = ExpertLoadWindow(model, config.eplb_window_size) if config.enable_eplb else None
        self.placement: ExpertPlacement | None = None
        self.steps_counted = 0
        # enable_return_routed_experts: the routing of every cached position, by block
        self.routing: RoutedExpertsRecorder | None = (
            RoutedExpertsRecorder(runner.layout.block_size, runner.null_block)
            if config.enable_return_routed_experts
            else None
        )

    def run(self, prepared: PreparedStep, input_ids: torch.Tensor) -> StepOutput:
        """Run a step. On the CPU the output carries its wall time (there the forward's wall
        time is its cost; the hardware verification schedule reads it)."""
        if self.runner.device.type != "cpu":
            return StepOutput(*self._run(prepared, input_ids))
        start = time.perf_counter()
        logits, features = self._run(prepared, input_ids)
        return StepOutput(logits, features, time.perf_counter() - start)

    def _run(self, prepared: PreparedStep, input_ids: torch.Tensor) -> StepResult:
        if self.tp is None:
            alone = self.config.batch_invariant and not self.model.invariant_rows
            if alone and len(prepared.chunks) > 1:
                return self._run_each_chunk(prepared)
            return self._execute(prepared, input_ids)
        if self.data_parallel:
            return self._run_data_parallel(self.tp, prepared, input_ids)
        self.tp.step(prepared.seq_chunks or [], input_ids, prepared.padding, prepared.batch.lora)
        return self.tp.checked(lambda: self._execute(prepared, input_ids))

    def _execute(self, prepared: PreparedStep, input_ids: torch.Tensor) -> StepResult:
        """One forward on this rank, ``batch_invariant``'s products and the routing record
        as configured."""
        batch = prepared.batch
        if batch.lora is not None:  # after the step before it, which may read the old slots
            batch.lora.write_slots()
        with invariant_products(batch.invariant), running_step(batch.lora):
            out = self.runner.execute(prepared, input_ids)
        if self.routing is not None and batch.routing is not None and prepared.seq_chunks is not None:
            seq = prepared.seq_chunks
            self.routing.record(
                [c.request for c in prepared.chunks],
                [s.start for s in seq],
                [s.num_tokens for s in seq],
                batch.routing,
                padded=prepared.padding is not None,
            )
        return out

    def _run_each_chunk(self, prepared: PreparedStep) -> StepResult:
        """``batch_invariant``: every chunk as a forward of its own (the kernels then see the
        shapes the chunk alone would give them), logits rows joined in chunk order."""
        parts = []
        for chunk in prepared.chunks:
            alone = self.runner.prepare([chunk])
            logits, _ = self._execute(alone, self.runner.input_ids(alone))
            rows = len(alone.seq_chunks[0].logits_offsets) if alone.seq_chunks else 0
            parts.append(logits[:rows])
        return torch.cat(parts), None

    def _run_data_parallel(
        self, tp: TensorParallelGroup, prepared: PreparedStep, input_ids: torch.Tensor
    ) -> StepResult:
        """Every rank its chunks (ids read now, at launch), rank 0's part here, then every
        rank's logits rows joined in rank order (the step's chunks are grouped by rank)."""
        seq_chunks = prepared.seq_chunks or []
        parts, rows = [], []
        for rank in range(tp.size):
            mine = prepared.on_rank(rank)
            rows.append(sum(len(seq_chunks[i].logits_offsets) for i in mine))
            if rank == 0:  # runs here
                parts.append(([], None))
            else:
                parts.append(([seq_chunks[i] for i in mine], self.runner.input_ids(prepared, rank).cpu()))
        tp.data_parallel_step(parts, rows)

        def run_here() -> torch.Tensor:
            logits, _ = self.runner.execute(prepared, input_ids)
            joined = gather_rows(logits, rows)
            if self.eplb is not None:
                reduce_expert_load(self.eplb.layers, idle=not prepared.on_rank(0))
            assert joined is not None
            return joined

        return tp.checked(run_here), None

    # ---- expert load balancing ------------------------------------------------------------

    def count_expert_load(self) -> None:
        """After a step: move its expert counts into the window; re-place every interval."""
        if self.eplb is None:
            return
        self.eplb.snapshot()
        self.steps_counted += 1
        if self.steps_counted % self.config.eplb_step_interval == 0:
            self.rebalance_experts()

    def rebalance_experts(self) -> ExpertPlacement:
        """Re-place the experts over the ranks for the load counted in the window (EPLB, with
        ``num_redundant_experts`` replicas of hot experts), moving weights between ranks in
        place; returns the new placement."""
        if self.eplb is None or self.tp is None:
            raise ValueError("rebalance_experts needs enable_eplb=True (expert parallel over several ranks)")
        load = self.eplb.total().float()
        experts = load.shape[1]
        placement = rebalance_experts(load, experts + self.config.num_redundant_experts, self.tp.size)
        before = self.moe_lb()
        self.tp.rebalance(self.model, placement)
        self.placement = placement
        logger.info("EPLB: moe_lb %.3f -> %.3f over the last window", before, self.moe_lb())
        return placement

    def moe_lb(self) -> float:
        """Slowest rank / mean rank of the counted expert load under the current placement
        (``deepinfer:moe_lb``; 1.0 before anything was counted)."""
        if self.eplb is None or self.tp is None:
            return 1.0
        load = self.eplb.total()
        if not load.any():
            return 1.0
        placement = self.placement or identity_placement(load.shape[0], load.shape[1], self.tp.size)
        return moe_lb(placement, load)
