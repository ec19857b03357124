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

import torch
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
        moe.phy2log = torch.arange(count)  # every rank's slots, in rank order (no replicas yet)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers in module order (EPLB's layer index)."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "expert_offset")]


def _expert_tensors(moe: nn.Module) -> list[str]:
    names = ("w1", "w2", "w3")
    if moe.holds_fp4:
        return [n + suffix for n in names for suffix in ("_fp4", "_fp4_scale")]
    return [f"{n}_stacked" for n in names]


@torch.no_grad()
def apply_placement(
    model: nn.Module, placement, rank: int, size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Move every MoE layer to ``placement`` (an ``eplb.ExpertPlacement`` over ``size``
    ranks), in place and on every rank at once (collective): each rank fills its new slots
    from its own old ones where it holds the expert, else from a rank that does, one expert
    broadcast at a time (each expert's weights cross the wire once, whoever needs them);
    the routers then send each expert's pairs round-robin over its replicas."""
    for index, moe in enumerate(moe_layers(model)):
        new = placement.phy2log[index]
        slots = new.shape[0] // size
        mine = new[rank * slots : (rank + 1) * slots].tolist()
        old = moe.phy2log
        old_slots = old.shape[0] // size
        held = old[rank * old_slots : (rank + 1) * old_slots].tolist()
        names = _expert_tensors(moe)
        current = {name: getattr(moe, name) for name in names}
        fresh = {name: t.new_empty(slots, *t.shape[1:]) for name, t in current.items()}
        for expert in range(len(moe.experts)):
            needed_by = {r for r in range(size) if expert in new[r * slots : (r + 1) * slots].tolist()}
            owners = [r for r in range(size) if expert in old[r * old_slots : (r + 1) * old_slots].tolist()]
            if not needed_by:
                continue
            remote = any(r not in owners for r in needed_by)
            for name in names:
                if expert in held:
                    value = current[name][held.index(expert)]
                else:
                    value = current[name].new_empty(current[name].shape[1:])
                if remote:  # one broadcast from the first owner reaches every rank
                    wire = (
                        value.contiguous().view(torch.uint8)
                        if value.element_size() == 1
                        else value.contiguous()
                    )
                    dist.broadcast(wire, src=owners[0], group=group)
                    value = wire.view(value.dtype)
                for slot, e in enumerate(mine):
                    if e == expert:
                        fresh[name][slot] = value
        for name, t in fresh.items():
            setattr(moe, name, t)
        moe.expert_offset = rank * slots
        moe.phy2log = new.clone()
        moe.replica_maps = (placement.log2phy[index].clone(), placement.replicas[index].clone())
        for expert in moe.experts:  # the stacked copies are the only expert weights now
            for name in ("w1", "w2", "w3"):
                if getattr(expert, name).weight is not None:
                    getattr(expert, name).weight = None
