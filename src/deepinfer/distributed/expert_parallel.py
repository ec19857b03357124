"""Expert parallelism for DeepSeek MoE layers: each rank keeps 1/N of every layer's routed
experts (contiguous ids, the identity placement of ``eplb.identity_placement``). Two ways
to reach them:

- tensor-parallel attention (every rank holds every token): every rank routes every token,
  runs its own experts on the pairs routed to them (the other pairs weighted zero) and one
  all-reduce sums the ranks' routed outputs, which is all-gather dispatch and reduce-scatter
  combine collapsed into one collective;
- data-parallel attention (each rank holds its own requests' tokens): ``AllToAllDispatch``
  sends each token once to every rank holding one of its experts, with the weights of the
  choices that rank serves, and sends the weighted sums back (two ``all_to_all_single``
  exchanges per layer, as DeepEP's normal kernels do), counting the bytes that cross.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.distributed.tensor_parallel import all_reduce_sum
from deepinfer.models.layers.moe import replica_slots


def shard_experts(
    model: nn.Module,
    rank: int,
    size: int,
    group: dist.ProcessGroup | None = None,
    all_to_all: bool = False,
) -> None:
    """Keep rank ``rank``'s routed experts in every MoE layer of ``model`` (in place).
    ``all_to_all``: the ranks hold different tokens (data-parallel attention), which each
    layer's ``AllToAllDispatch`` exchanges; else an all-reduce sums the routed outputs."""
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
        if all_to_all:
            moe.dispatch = AllToAllDispatch(rank, size, group)
        else:
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


class AllToAllDispatch:
    """A MoE layer's token exchange under data-parallel attention (``MoE.dispatch``).

    Physical expert slots are laid out rank by rank (``held`` per rank), so a pair routed to
    slot s goes to rank s // held. Each token is sent once to every rank serving at least one
    of its choices (to itself without crossing the wire), with its k weights zeroed for the
    choices that rank does not serve; that rank runs its experts and sends back one weighted
    sum per token, which the origin adds up. The counters are what crossed to other ranks:
    ``dispatch_rows`` tokens out and ``combine_rows`` sums back, ``payload_bytes`` their
    hidden vectors and ``meta_bytes`` the weights and slot ids sent with them.
    """

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.tokens = 0
        self.dispatch_rows = 0
        self.combine_rows = 0
        self.payload_bytes = 0
        self.meta_bytes = 0

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def __call__(
        self, moe: nn.Module, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        held = moe.held_experts
        if moe.replica_maps is not None:
            ids = replica_slots(ids, *moe.replica_maps)
        dest = torch.div(ids, held, rounding_mode="floor")
        picks = [(dest == r).any(1).nonzero().squeeze(1) for r in range(self.size)]
        send = [int(p.numel()) for p in picks]
        index = torch.cat(picks)
        counts = torch.tensor(send, dtype=torch.long, device=ids.device)  # NCCL: on the device
        target = torch.repeat_interleave(torch.arange(self.size, device=ids.device), counts)
        served = dest[index] == target[:, None]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv = recv_counts.tolist()
        x = self._exchange(flat[index], send, recv)
        w = self._exchange(weights[index] * served, send, recv)
        slots = self._exchange((ids[index] - target[:, None] * held).masked_fill(~served, 0), send, recv)
        out = moe.run_routed(x, w, slots)
        back = self._exchange(out, recv, send)
        self._count(flat, weights, send, recv)
        return flat.new_zeros(flat.shape[0], back.shape[1]).index_add_(0, index, back.to(flat.dtype))

    def _count(self, flat: torch.Tensor, weights: torch.Tensor, send: list[int], recv: list[int]) -> None:
        remote_out = sum(n for r, n in enumerate(send) if r != self.rank)
        remote_back = sum(n for r, n in enumerate(recv) if r != self.rank)
        row = flat.shape[1] * flat.element_size()
        meta = weights.shape[1] * (weights.element_size() + 8)  # weights and int64 slot ids
        self.tokens += flat.shape[0]
        self.dispatch_rows += remote_out
        self.combine_rows += remote_back
        self.payload_bytes += (remote_out + remote_back) * row
        self.meta_bytes += remote_out * meta


def expected_remote_ranks(ranks: int, top_k: int, experts: int | None = None) -> float:
    """Other ranks a token reaches when its k distinct experts are a uniform draw of the
    ``experts`` (E / N per rank): a given other rank is missed with probability
    C(E - E/N, k) / C(E, k). ``experts`` None: the large-E limit, 1 - (1 - 1/N)^k per rank."""
    if experts is None:
        miss = (1.0 - 1.0 / ranks) ** top_k
    else:
        per_rank = experts // ranks
        miss = 1.0
        for i in range(top_k):
            miss *= max(0, experts - per_rank - i) / (experts - i)
    return (ranks - 1) * (1.0 - miss)


def dispatch_bytes_per_token(
    ranks: int, top_k: int, dispatch_row: int, combine_row: int, experts: int | None = None
) -> float:
    """All-to-all bytes one token causes per MoE layer (dispatch out plus combine back), with
    ``dispatch_row`` / ``combine_row`` bytes per token and remote rank."""
    return expected_remote_ranks(ranks, top_k, experts) * (dispatch_row + combine_row)
