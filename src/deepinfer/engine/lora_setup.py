"""How the engine serves LoRA adapters: which step modes a model's adapter targets allow, and
the registry of adapters and slots over its target linears."""

from __future__ import annotations

import logging

from deepinfer.config import EngineConfig
from deepinfer.lora.registry import LoraRegistry
from deepinfer.lora.targets import find_targets
from deepinfer.models.base import CausalLM

logger = logging.getLogger("deepinfer")


def step_modes(
    config: EngineConfig, model: CausalLM, use_compile: bool, use_graphs: bool
) -> tuple[bool, bool]:
    """Compiled steps and graphs as chosen, for a model whose every adapter target is part of a
    fused projection (the step hands each row's slot to ``deepinfer::lora_add``). One whose
    targets reach past them (DeepSeek V4's routed experts and other linears) adds their terms
    from the running step's Python context, which neither a compiled step nor a graph replay
    runs: eager steps, and a refusal where the user asked for either."""
    if all(t.kind == "projection" for t in find_targets(model).values()):
        return use_compile, use_graphs
    for name, asked in (("compile", config.compile), ("capture_graphs", config.capture_graphs)):
        if asked:
            raise ValueError(
                f"enable_lora=True with {name}=True: {type(model).__name__} has adapter targets "
                f"outside its fused projections (routed experts, other linears); set {name}=False"
            )
    if use_compile or use_graphs:
        logger.info("enable_lora: %s runs eager steps (adapters past its projections)", type(model).__name__)
    return False, False


def registry(model: CausalLM, config: EngineConfig) -> LoraRegistry | None:
    """The served adapters' registry (``enable_lora``), over the model's target linears."""
    if not config.enable_lora:
        return None
    assert config.max_cpu_loras is not None  # set by validate
    return LoraRegistry(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
