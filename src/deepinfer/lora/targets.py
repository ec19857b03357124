"""Which linears of a served model take an adapter, and how a step reaches each one.

Three ways, by how the engine computes the linear:
- a linear inside a ``Projection`` (Llama's q/k/v, o, gate/up, down): the projection adds the
  term after its engine form (fused, packed or quantized weight), one stack per projection;
- a linear the model calls as a module on the step's rows (DeepSeek-V4 attention's ``wq_a``,
  ``wq_b``, ``wkv``, ``wo_b``; the compressors' ``wkv``/``wgate``; the indexers' ``wq_b`` and
  ``weights_proj``; V4.1's Engram ``wkv``; the shared expert's ``w1``/``w2``/``w3``): a
  forward hook adds it;
- a routed expert's ``w1``/``w2``/``w3``: the MoE layer runs its experts with the term inside
  the SwiGLU (``MoE.run_routed``), one stack per layer.
Linears whose weight the model reads directly (V4's grouped ``wo_a``, the router) and the
output head are not targets: an adapter naming them is refused when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.models.layers.attention import LatentAttention
from deepinfer.models.layers.compressor import Compressor
from deepinfer.models.layers.engram import Engram
from deepinfer.models.layers.indexer import Indexer
from deepinfer.models.layers.lora import ExpertStack, LinearStack, current_step
from deepinfer.models.layers.moe import MoE
from deepinfer.models.layers.projection import Projection
from deepinfer.models.layers.shared_indexer import SharedIndexer

# the linears each module type calls as modules on every row of the step
HOOKED = {
    LatentAttention: ("wq_a", "wq_b", "wkv", "wo_b"),
    Compressor: ("wkv", "wgate"),
    Engram: ("wkv",),
    Indexer: ("wq_b", "weights_proj"),
    SharedIndexer: ("wq_b", "weights_proj"),
}


@dataclass(frozen=True)
class Target:
    """One target linear: ``owner`` is its Projection (``index`` among its linears), the
    linear itself (hooked), or its MoE layer (``index`` = expert, ``name`` = w1/w2/w3)."""

    kind: str  # "projection", "module" or "expert"
    owner: Any
    index: int
    name: str
    in_features: int
    out_features: int


def find_targets(model: nn.Module) -> dict[str, Target]:
    """The model's target linears by module name."""
    names = {id(m): n for n, m in model.named_modules()}
    head = getattr(model, "head", None)
    found: dict[str, Target] = {}

    def add(kind: str, linear: nn.Linear, owner: Any, index: int = 0, name: str = "") -> None:
        found[names[id(linear)]] = Target(kind, owner, index, name, linear.in_features, linear.out_features)

    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Projection) and value is not head:
                for i, linear in enumerate(value.linears):
                    if isinstance(linear, nn.Linear) and id(linear) in names:
                        add("projection", linear, value, i)
        for kind, attrs in HOOKED.items():
            if isinstance(module, kind):
                for attr in attrs:
                    linear = getattr(module, attr)
                    if isinstance(linear, nn.Linear):  # a compressor of ratio 1 has no wgate
                        add("module", linear, linear)
        if isinstance(module, MoE):
            for attr in ExpertStack.NAMES:
                add("module", getattr(module.shared_experts, attr), getattr(module.shared_experts, attr))
            if not module.holds_fp4:  # fp4-resident experts have no float linears to adapt
                for e, expert in enumerate(module.experts):
                    for attr in ExpertStack.NAMES:
                        add("expert", getattr(expert, attr), module, e, attr)
    return found


def _hook(module: nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
    """A hooked linear's forward: its output plus the step's low-rank term."""
    step = current_step()
    if step is None:
        return None
    x = inputs[0]
    flat = x.reshape(-1, x.shape[-1])
    y = output.reshape(-1, output.shape[-1])
    return module.lora_stack.add_to(y, flat, step).view(output.shape)


def stack_for(target: Target, slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> Any:
    """The target's slot stack, made (and wired into the step) on first use."""
    owner = target.owner
    if target.kind == "expert":
        if getattr(owner, "lora_experts", None) is None:
            expert = owner.experts[0]
            shapes = {n: tuple(getattr(expert, n).weight.shape) for n in ExpertStack.NAMES}
            owner.lora_experts = ExpertStack(len(owner.experts), shapes, slots, rank, dtype, device)
        return owner.lora_experts
    if target.kind == "projection":
        if owner.lora is None:
            linears = owner.linears
            owner.lora = LinearStack(
                linears[0].in_features, [li.out_features for li in linears], slots, rank, dtype, device
            )
        return owner.lora
    if getattr(owner, "lora_stack", None) is None:
        owner.lora_stack = LinearStack(target.in_features, [target.out_features], slots, rank, dtype, device)
        owner.register_forward_hook(_hook)
    return owner.lora_stack
