"""Expert parallelism for DeepSeek MoE layers: each rank keeps 1/N of every layer's routed
experts (contiguous ids, the identity placement of ``eplb.identity_placement``); every rank
routes every token, runs its own experts on the pairs routed to them (the other pairs
weighted zero) and one all-reduce sums the ranks' routed outputs, which is all-gather
dispatch and reduce-scatter combine collapsed into one collective for a batch every rank
holds. Attention and the shared expert are computed whole on every rank (data-parallel
attention, which would split the requests, is not built yet).
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import nn

from deepinfer.distributed.tensor_parallel import all_reduce_sum


def shard_experts(model: nn.Module, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Keep rank ``rank``'s routed experts in every MoE layer of ``model`` (in place)."""
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "expert_offset")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no routed experts to split")
    for moe in layers:
        count = len(moe.experts)
        if count % size:
            raise ValueError(f"expert parallel size {size} does not divide the {count} routed experts")
        held = count // size
        first = rank * held
        names = ("w1", "w2", "w3")
        if moe.holds_fp4:
            for name in names:
                for suffix in ("_fp4", "_fp4_scale"):
                    full = getattr(moe, name + suffix)
                    setattr(moe, name + suffix, full[first : first + held].clone())
        else:
            if moe.w1_stacked is None:
                moe.stack_experts()
            for name in names:
                local = getattr(moe, f"{name}_stacked")[first : first + held].clone()
                setattr(moe, f"{name}_stacked", local)
                for i, expert in enumerate(moe.experts):
                    inside = first <= i < first + held
                    getattr(expert, name).weight = (
                        nn.Parameter(local[i - first], requires_grad=False) if inside else None
                    )
        moe.expert_offset = first
        moe.reduce = functools.partial(all_reduce_sum, group=group)
