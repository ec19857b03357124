"""Expert-parallel load balancing (EPLB): where each routed expert's replicas live.

Given each layer's load per logical expert (tokens routed to it over a window of steps),
``rebalance_experts`` chooses ``num_physical`` expert slots over ``num_ranks`` ranks: hot
experts get redundant replicas and every rank gets the same number of slots, so the
slowest rank carries about the mean load. The policy follows DeepSeek's published EPLB
algorithm (deepseek-ai/EPLB on GitHub), written here from a description of it rather than
from its code:

1. hierarchical (when the expert groups divide evenly among the nodes): whole groups are
   packed onto nodes, balancing group loads;
2. within each node, the logical expert with the highest load per replica gets the next
   redundant replica until the node's slots are used;
3. each node's replicas (each carrying load / replica count) are packed onto its ranks,
   every rank getting the same number of slots.

The global policy is the same with one group and one node. Packing is greedy
longest-processing-time: heaviest item first, into the lightest pack that has room.

``moe_lb`` is the balance metric DeepSeek quotes (slowest rank / mean, 1.045-1.090 in
production; vLLM logs the inverse), computed with each logical expert's tokens split evenly
over its replicas, which is how ``physical_ids`` dispatches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.models.layers.moe import replica_slots


@dataclass(frozen=True)
class ExpertPlacement:
    """Where every layer's experts live: ``phy2log`` [L, P] the logical expert of each
    physical slot (slot p on rank p // (P / ranks)), ``log2phy`` [L, E, max replicas] each
    logical expert's slots (-1 padded), ``replicas`` [L, E] how many each has."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    replicas: torch.Tensor
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks


def balanced_packing(weights: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [n] into ``num_packs`` packs of exactly n / num_packs items each, heaviest item
    first into the lightest pack with room. Returns (pack of each item, its place in the
    pack)."""
    n = weights.shape[0]
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    pack = torch.empty(n, dtype=torch.long)
    place = torch.empty(n, dtype=torch.long)
    loads = [0.0] * num_packs
    counts = [0] * num_packs
    for item in torch.argsort(weights, descending=True, stable=True).tolist():
        target = min((p for p in range(num_packs) if counts[p] < per_pack), key=lambda p: loads[p])
        pack[item], place[item] = target, counts[target]
        loads[target] += float(weights[item])
        counts[target] += 1
    return pack, place


def replicate_experts(load: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical loads [m] onto ``num_slots`` >= m slots: each expert once, then each spare slot
    to the expert with the highest load per replica. Returns (logical expert of each slot,
    replica count per expert)."""
    m = load.shape[0]
    if num_slots < m:
        raise ValueError(f"{num_slots} slots cannot hold {m} experts")
    owner = list(range(m))
    count = torch.ones(m, dtype=torch.long)
    for _ in range(num_slots - m):
        hottest = int(torch.argmax(load.double() / count))
        owner.append(hottest)
        count[hottest] += 1
    return torch.tensor(owner, dtype=torch.long), count


def _rebalance_layer(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """One layer: the logical expert of each physical slot [num_physical], rank-major."""
    experts = load.shape[0]
    group_size = experts // num_groups
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    group_node, _ = balanced_packing(load.view(num_groups, group_size).sum(1), num_nodes)
    phy2log = torch.empty(num_physical, dtype=torch.long)
    for node in range(num_nodes):
        groups = torch.nonzero(group_node == node).squeeze(1)
        logical = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
        owner, count = replicate_experts(load[logical], slots_per_node)
        rank, place = balanced_packing(load[logical][owner] / count[owner], ranks_per_node)
        slot = rank * (slots_per_node // ranks_per_node) + place
        phy2log[node * slots_per_node + slot] = logical[owner]
    return phy2log


def rebalance_experts(
    load: torch.Tensor, num_physical: int, num_ranks: int, num_groups: int = 1, num_nodes: int = 1
) -> ExpertPlacement:
    """Placement for loads [L, E] (tokens per logical expert) on ``num_ranks`` ranks with
    ``num_physical`` slots in all (E plus the redundant ones). Hierarchical when the expert
    groups divide among the nodes, else global."""
    layers, experts = load.shape
    if num_physical % num_ranks or num_physical < experts:
        raise ValueError(
            f"num_physical={num_physical} must be >= {experts} experts and a multiple of num_ranks={num_ranks}"
        )
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} must be a multiple of num_nodes={num_nodes}")
    if experts % num_groups or num_groups % num_nodes:
        num_groups = num_nodes = 1  # the global policy
    phy2log = torch.stack(
        [
            _rebalance_layer(load[i].float(), num_physical, num_groups, num_nodes, num_ranks)
            for i in range(layers)
        ]
    )
    replicas = torch.stack([torch.bincount(row, minlength=experts) for row in phy2log])
    log2phy = torch.full((layers, experts, int(replicas.max())), -1, dtype=torch.long)
    for i in range(layers):
        seen = [0] * experts
        for slot, e in enumerate(phy2log[i].tolist()):
            log2phy[i, e, seen[e]] = slot
            seen[e] += 1
    return ExpertPlacement(phy2log, log2phy, replicas, num_ranks)


def identity_placement(layers: int, experts: int, num_ranks: int) -> ExpertPlacement:
    """No redundancy: expert e on rank e // (E / ranks), the placement before any rebalance."""
    phy2log = torch.arange(experts).expand(layers, -1).clone()
    return ExpertPlacement(
        phy2log, phy2log.unsqueeze(-1).clone(), torch.ones(layers, experts, dtype=torch.long), num_ranks
    )


def rank_loads(placement: ExpertPlacement, load: torch.Tensor) -> torch.Tensor:
    """Tokens each rank computes per layer [L, ranks], a logical expert's tokens split evenly
    over its replicas."""
    per_slot = load.float().gather(1, placement.phy2log) / placement.replicas.gather(1, placement.phy2log)
    return per_slot.view(load.shape[0], placement.num_ranks, -1).sum(-1)


def moe_lb(placement: ExpertPlacement, load: torch.Tensor) -> float:
    """Slowest rank / mean rank, summed over layers as a step runs them one after another."""
    ranks = rank_loads(placement, load)
    return float(ranks.max(1).values.sum() / ranks.mean(1).sum())


def physical_ids(placement: ExpertPlacement, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The physical slot serving each (token, choice) of logical ``ids`` [N, k] in ``layer``
    (round-robin over the expert's replicas: ``models/layers/moe.replica_slots``)."""
    return replica_slots(ids, placement.log2phy[layer], placement.replicas[layer])


class ExpertLoadWindow:
    """Per-expert load counters of every MoE layer of ``model`` (the layers' ``expert_load``
    buffers, bumped on the device by each eager step's router, no host sync) and a ring of
    the last ``window`` snapshots: ``snapshot()`` after a step (or every few steps) moves the
    counts into the ring; ``total()`` is the [L, E] load ``rebalance_experts`` takes."""

    def __init__(self, model: nn.Module, window: int) -> None:
        found = [
            (n, m) for n, m in model.named_modules() if hasattr(m, "expert_load") and hasattr(m, "experts")
        ]
        self.names = [n for n, _ in found]  # draft layers (``mtp.*``) count only while drafting
        self.layers = [m for _, m in found]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE layers to count")
        for layer in self.layers:
            device = next(layer.parameters()).device
            layer.expert_load = torch.zeros(len(layer.experts), dtype=torch.long, device=device)
        self.ring: list[torch.Tensor] = []
        self.window = window

    def snapshot(self) -> None:
        counts = torch.stack([layer.expert_load for layer in self.layers])
        self.ring = [*self.ring, counts.clone()][-self.window :]
        for layer in self.layers:
            layer.expert_load.zero_()

    def total(self) -> torch.Tensor:
        """Tokens per expert per layer over the window [L, E] (on the host)."""
        experts = self.layers[0].expert_load.shape[0]
        if not self.ring:
            return torch.zeros(len(self.layers), experts, dtype=torch.long)
        return torch.stack(self.ring).sum(0).cpu()

    def close(self) -> None:
        """Stop counting."""
        for layer in self.layers:
            layer.expert_load = None
