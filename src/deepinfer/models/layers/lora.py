"""The low-rank terms of served LoRA adapters, as the layers compute them in a step.

``LoraStep`` is the running step's rows by adapter slot, set by the engine around one forward
(``running_step``) and read by ``Projection``, the hooked linears and the routed experts;
outside a step (research calls, drafters) nothing is set and the base weights alone compute.

A stack holds every slot's A and B of one target (rank ``R = max_lora_rank``; a smaller rank
is zero-padded, and each slot's scale is folded into its B). A step's adapter rows are grouped
by slot and each group multiplies only its own adapter's matrices: the punica/S-LoRA grouped
product (SGMV). Decode-sized groups on the CPU in fp32 take one kernel call per target
(``kernels/cpu/lora.cpp``); otherwise one batched shrink and expand cover all slots at once, with
the groups padded to one size (decode), or one product pair runs per group (prefill). Mixed
adapters and base rows run in one step and a row costs its own rank only. Which form runs
depends on the step's largest group, so a row's term may round differently in another batch
(as the base matmuls' do); it never mixes in another slot's matrices. The routed
experts use a per-row slot mask instead (``ExpertStack``). Which adapters hold which slots is
``deepinfer.lora``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu import lora as cpu_lora


@dataclass(frozen=True)
class LoraStep:
    """A step's rows by adapter slot (a base-model row has none), in the two forms the
    layers use.

    Grouped (dense layers): the adapter rows sorted by slot. ``padded``: every slot gets
    ``width`` positions, ``index`` [slots * width] names each position's row (padding: row 0,
    its term zeroed by ``valid`` [slots, width, 1]; None: no padding), and one batched product per matrix covers
    all slots (decode steps: a few rows per adapter). Otherwise ``index`` lists the rows and
    ``segments`` (slot, start, end) the slots' runs in it, one product per run (prefill: long
    runs, where padding would cost). ``mask`` [T, slots * rank]: row t is 1 over its slot's
    rank columns (the routed experts' form; None in a model without routed experts)."""

    rows: int
    active: frozenset[int]
    padded: bool
    index: torch.Tensor
    valid: torch.Tensor | None
    width: int
    segments: tuple[tuple[int, int, int], ...]
    mask: torch.Tensor | None
    # the CPU kernel's form: the adapter rows sorted by slot, each group's slot, and each
    # group's start with the end after the last (int64, on the host)
    order: torch.Tensor
    group_slots: torch.Tensor
    group_starts: torch.Tensor
    # each row's slot [T] on the host (-1: none), which a compiled step reads on its device
    slots: torch.Tensor | None = None
    # the slot tensors to write before the forward (adapters newly given a slot): run by
    # the thread that runs the step, after the step before it
    slot_writes: tuple[Callable[[], None], ...] = ()
    # (slot, adapter uid, adapter path) of every slot the step uses: what a tensor-parallel
    # worker places in its own slots before it runs the step (``LoraRegistry.follow``)
    placements: tuple[tuple[int, int, str], ...] = ()

    def write_slots(self) -> None:
        """Fill the slots this step gave to new adapters (once; the step's forward reads them)."""
        for write in self.slot_writes:
            write()
        object.__setattr__(self, "slot_writes", ())

    @staticmethod
    def build(
        slot_rows: torch.Tensor,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        experts: bool = True,
        slot_writes: tuple[Callable[[], None], ...] = (),
        placements: tuple[tuple[int, int, str], ...] = (),
    ) -> LoraStep:
        """From each row's slot (``slot_rows`` [T] on the host, -1 for the base model);
        ``experts``: the model has routed experts, which read the mask; ``slot_writes``: the
        slot fills the step runs first; ``placements``: the adapters in the step's slots."""
        lora_rows = (slot_rows >= 0).nonzero().flatten()
        by_slot = torch.argsort(slot_rows[lora_rows], stable=True)
        rows, row_slots = lora_rows[by_slot], slot_rows[lora_rows][by_slot]
        counts = torch.bincount(row_slots, minlength=slots)
        width, n = int(counts.max()), int(rows.numel())
        padded = slots * width <= 2 * n + slots
        starts = torch.cumsum(counts, 0) - counts
        valid = None
        if padded:
            position = row_slots * width + torch.arange(n) - starts[row_slots]
            index = torch.zeros(slots * width, dtype=torch.long)
            index[position] = rows
            if n < slots * width:
                flags = torch.zeros(slots * width, dtype=dtype)
                flags[position] = 1
                valid = flags.view(slots, width, 1).to(device)
        else:
            index = rows
        segments = tuple((s, int(starts[s]), int(starts[s] + counts[s])) for s in range(slots) if counts[s])
        mask = None
        if experts:
            columns = torch.arange(slots).repeat_interleave(rank)
            mask = (slot_rows.unsqueeze(1) == columns.unsqueeze(0)).to(dtype).to(device)
        active = frozenset(s for s, _, _ in segments)
        group_slots = torch.tensor([s for s, _, _ in segments], dtype=torch.long)
        group_starts = torch.tensor([start for _, start, _ in segments] + [n], dtype=torch.long)
        return LoraStep(
            slot_rows.shape[0],
            active,
            padded,
            index.to(device),
            valid,
            width,
            segments,
            mask,
            rows,
            group_slots,
            group_starts,
            slot_rows,
            slot_writes,
            placements,
        )

    def check(self, x: torch.Tensor) -> None:
        """An input must hold the step's rows (its tokens), or the slots would be misread."""
        if x.shape[0] != self.rows:
            raise RuntimeError(f"a LoRA target ran on {x.shape[0]} rows in a step of {self.rows} tokens")

    def rows_mask(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        assert self.mask is not None, "built without the routed experts' mask"
        return self.mask


_current: ContextVar[LoraStep | None] = ContextVar("deepinfer_lora_step", default=None)


def current_step() -> LoraStep | None:
    """The running step's adapter rows (None: no adapter in the step, or no step)."""
    return _current.get()


@contextlib.contextmanager
def running_step(step: LoraStep | None) -> Iterator[None]:
    """Make ``step`` current for one forward."""
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)


class LinearStack:
    """The slots of ``len(outs)`` linears that read one input (a fused projection: q, k, v),
    their outputs concatenated in that order. Per slot, A is [in, n * R] (the linears' A side
    by side: one shrink serves them all) and each linear's B is [R, out]."""

    def __init__(
        self,
        in_features: int,
        outs: list[int],
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.outs, self.slots, self.rank = outs, slots, rank
        self.offsets = [sum(outs[:i]) for i in range(len(outs))]
        self.a = torch.zeros(slots, in_features, len(outs) * rank, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, rank, out, dtype=dtype, device=device) for out in outs]
        self.filled: set[int] = set()  # slots holding an update
        self.matrices = cpu_lora.Matrices(self.a, self.b, rank)

    def load(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slot ``slot`` of linear ``index`` takes ``scale * b @ a`` (scale folded into B)."""
        r = a.shape[0]
        with torch.no_grad():
            self.a[slot, :, index * self.rank : (index + 1) * self.rank].zero_()
            self.a[slot, :, index * self.rank : index * self.rank + r].copy_(a.T)
            self.b[index][slot].zero_()
            self.b[index][slot, :r].copy_((b * scale).T)
        self.filled.add(slot)

    def clear(self, slot: int) -> None:
        """Slot ``slot`` back to zero in every linear."""
        if slot in self.filled:
            with torch.no_grad():
                self.a[slot].zero_()
                for b in self.b:
                    b[slot].zero_()
            self.filled.discard(slot)

    def _columns(self, y: torch.Tensor, index: int) -> torch.Tensor:
        """Linear ``index``'s output columns of ``y``."""
        return y[:, self.offsets[index] : self.offsets[index] + self.outs[index]]

    def add_to(self, y: torch.Tensor, x: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """``y`` [T, sum(outs)] plus the rows' low-rank terms (in place; returns ``y``)."""
        step.check(x)
        if not self.filled & step.active:
            return y
        if step.width <= cpu_lora.BLOCK_ROWS and cpu_lora.supports(x, y):  # decode-sized groups
            return cpu_lora.sgmv(y, x, step.order, step.group_slots, step.group_starts, self.matrices)
        r = self.rank
        if step.padded:
            grouped = x.index_select(0, step.index).view(self.slots, step.width, -1)
            shrunk = torch.bmm(grouped, self.a)
            if step.valid is not None:  # padding positions add nothing
                shrunk.mul_(step.valid)
            if len(self.b) == 1:
                return y.index_add_(0, step.index, torch.bmm(shrunk, self.b[0]).view(-1, y.shape[-1]))
            terms = [torch.bmm(shrunk[..., i * r : (i + 1) * r], b) for i, b in enumerate(self.b)]
            return y.index_add_(0, step.index, torch.cat(terms, dim=-1).view(-1, y.shape[-1]))
        picked = x.index_select(0, step.index)
        for slot, start, end in step.segments:
            if slot in self.filled:
                shrunk = torch.mm(picked[start:end], self.a[slot])
                rows = step.index[start:end]
                for i, b in enumerate(self.b):
                    self._columns(y, i).index_add_(0, rows, torch.mm(shrunk[:, i * r : (i + 1) * r], b[slot]))
        return y


class ExpertStack:
    """The slots of one MoE layer's routed experts: per expert and matrix (w1, w2, w3)."""

    NAMES = ("w1", "w2", "w3")

    def __init__(
        self, experts: int, shapes: dict[str, tuple[int, int]], slots: int, rank: int, dtype, device
    ) -> None:
        self.slots, self.rank = slots, rank
        width = slots * rank
        self.a = {
            n: torch.zeros(experts, width, shapes[n][1], dtype=dtype, device=device) for n in self.NAMES
        }
        self.b = {
            n: torch.zeros(experts, shapes[n][0], width, dtype=dtype, device=device) for n in self.NAMES
        }
        self.filled: dict[tuple[int, str], set[int]] = {}

    def load(self, slot: int, expert: int, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        cols, r = slice(slot * self.rank, (slot + 1) * self.rank), a.shape[0]
        with torch.no_grad():
            self.a[name][expert, cols].zero_()
            self.a[name][expert, slot * self.rank : slot * self.rank + r].copy_(a)
            self.b[name][expert, :, cols].zero_()
            self.b[name][expert, :, slot * self.rank : slot * self.rank + r].copy_(b * scale)
        self.filled.setdefault((expert, name), set()).add(slot)

    def clear(self, slot: int) -> None:
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        with torch.no_grad():
            for (expert, name), held in self.filled.items():
                if slot in held:
                    self.a[name][expert, cols].zero_()
                    self.b[name][expert, :, cols].zero_()
                    held.discard(slot)

    @property
    def any(self) -> bool:
        return any(self.filled.values())

    def term(self, expert: int, name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The low-rank term of expert ``expert``'s ``name`` on rows ``x`` whose slot masks
        are ``mask`` (None where no slot holds an update there)."""
        if not self.filled.get((expert, name)):
            return None
        return F.linear(F.linear(x, self.a[name][expert]) * mask, self.b[name][expert])
