"""The engine's adapters: loaded by name, given one of ``max_loras`` slots while a step uses
them, and turned into each step's per-row slot mask.

Adapters stay in host memory by name, at most ``max_cpu_loras`` of them: the ones loaded by
name (``load``: the server's ``--lora-modules`` and load endpoint) stay until unloaded; the
ones a ``LoRARequest`` brought are dropped least recently used first (a request holds its
adapter until it ends, and a later request reads the path again). A step's adapters take slots
in the targets' stacks; a slot whose adapter the step does not use is reused least recently
used first. The scheduler never runs more than ``max_loras`` adapters at once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepinfer.lora.peft_format import Adapter, read_adapter
from deepinfer.lora.request import LoRARequest  # re-exported: what ``adapter_for`` takes
from deepinfer.lora.targets import Target, find_targets, stack_for
from deepinfer.models.layers.lora import LoraStep


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter the engine holds. ``uid`` is unique per load: it keys the prefix cache, so
    blocks computed with one adapter (or one load of it) are never served to another."""

    name: str
    int_id: int
    uid: int
    adapter: Adapter
    pinned: bool  # loaded by name: stays until unloaded
    stacks: list[Any] = field(default_factory=list)  # the stacks its slot touched

    @property
    def cache_key(self) -> str:
        return f"lora:{self.uid}"


class LoraRegistry:
    """Adapters by name, their slots, and the step mask (``EngineConfig.enable_lora``)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        param = next(model.parameters())
        self.dtype, self.device = getattr(model, "compute_dtype", param.dtype), param.device
        self.targets: dict[str, Target] = find_targets(model)
        # tensor parallel: the projections this rank holds a cut of; adapters are read whole
        # (checked against the checkpoint's shapes) and cut the same way
        self.splits = {
            n: t.owner.split
            for n, t in self.targets.items()
            if t.kind == "projection" and t.owner.split is not None
        }
        self.linears = {n: _whole_shape(t, self.splits.get(n)) for n, t in self.targets.items()}
        self._experts = any(t.kind == "expert" for t in self.targets.values())  # steps need the mask
        self.adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self.slots: list[LoadedAdapter | None] = [None] * max_loras
        self._slot_order: list[int] = list(range(max_loras))  # least recently used first
        # each slot's latest placement (version, its tensor writes) and the version its tensors
        # hold: a step runs the writes of its slots not yet applied, so a step prepared and
        # never run (it failed) leaves them to the next step that uses the slot
        self._versions = itertools.count(1)
        self._placed: dict[int, tuple[int, list[Callable[[], None]]]] = {}
        self._applied: dict[int, int] = {}
        self._fill_lock = threading.Lock()  # steps may run on the asynchronous worker
        self._uids = itertools.count(1)
        self._lock = threading.Lock()  # the server loads from its own thread

    # ---- adapters by name -----------------------------------------------------------------

    def load(self, name: str, path: str, int_id: int | None = None, pinned: bool = True) -> LoadedAdapter:
        """Read and check the adapter at ``path`` and hold it as ``name``; a bad adapter
        raises ``ValueError`` and leaves the held ones as they were."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a non-empty string, got {path!r}")
        if name in self.adapters:
            raise ValueError(f"lora_name {name!r} is loaded already; unload it first")
        adapter = self._read(path)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"lora_name {name!r} is loaded already; unload it first")
            if len(self.adapters) >= self.max_cpu_loras and not self._drop_unpinned():
                raise ValueError(
                    f"max_cpu_loras={self.max_cpu_loras} adapters are loaded by name; unload one first"
                )
            if int_id is None:
                int_id = max((a.int_id for a in self.adapters.values()), default=0) + 1
            loaded = LoadedAdapter(name, int_id, next(self._uids), adapter, pinned)
            self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        """Forget ``name``: new requests cannot use it; running ones finish with it."""
        with self._lock:
            if name not in self.adapters:
                raise ValueError(
                    f"lora_name {name!r} is not loaded (loaded: {', '.join(self.adapters) or 'none'})"
                )
            del self.adapters[name]

    def _drop_unpinned(self) -> bool:
        """Make room by dropping the least recently used adapter a request brought."""
        for name, loaded in self.adapters.items():
            if not loaded.pinned:
                del self.adapters[name]
                return True
        return False

    def resolve(self, request: object) -> LoadedAdapter:
        """The adapter a request's ``lora_request`` names, read from its path the first time."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        loaded = self.adapters.get(request.lora_name)
        if loaded is not None:
            if loaded.int_id != request.lora_int_id:
                raise ValueError(
                    f"lora_request: {request.lora_name!r} is loaded with lora_int_id {loaded.int_id}, "
                    f"not {request.lora_int_id}"
                )
            with self._lock:
                self.adapters.move_to_end(request.lora_name)
            return loaded
        if request.lora_path is None:
            raise ValueError(f"lora_request: {request.lora_name!r} is not loaded and names no lora_path")
        return self.load(request.lora_name, request.lora_path, request.lora_int_id, pinned=False)

    # ---- slots and steps ------------------------------------------------------------------

    def _place(self, loaded: LoadedAdapter, keep: set[int]) -> int:
        """The slot holding ``loaded``, given the least recently used slot outside ``keep``
        (the step's other adapters) if it has none. The slot's tensors are written when a step
        using it runs (``_fill``): under asynchronous scheduling the step in flight may still
        read the slot's previous adapter."""
        if loaded in self.slots:
            slot = self.slots.index(loaded)
        else:
            slot = next(s for s in self._slot_order if s not in keep)
            self._placed[slot] = (next(self._versions), self._slot_writes(slot, loaded))
        self._slot_order.remove(slot)
        self._slot_order.append(slot)
        return slot

    def _slot_writes(self, slot: int, loaded: LoadedAdapter) -> list[Callable[[], None]]:
        """Give ``slot`` to ``loaded``: the writes that clear its previous adapter's matrices
        and load ``loaded``'s (run later, by the step that uses the slot)."""
        writes: list[Callable[[], None]] = []
        previous = self.slots[slot]
        if previous is not None:
            writes += [functools.partial(stack.clear, slot) for stack in previous.stacks]
            previous.stacks = []
        for module, update in loaded.adapter.updates.items():
            target = self.targets[module]
            stack = stack_for(target, self.max_loras, self.max_rank, self.dtype, self.device)
            if target.kind == "expert":
                args = (slot, target.index, target.name, update.a, update.b, update.scale)
            else:
                args = (slot, target.index, update.a, update.b, update.scale)
            writes.append(functools.partial(stack.load, *args))
            if stack not in loaded.stacks:
                loaded.stacks.append(stack)
        self.slots[slot] = loaded
        return writes

    def _read(self, path: str) -> Adapter:
        """The adapter at ``path``, checked against the checkpoint's shapes, then cut to this
        rank's share of each split projection (tensor parallel: q/k/v and gate/up by output
        rows, so B's rows; o and down by input columns, so A's columns, whose partial terms
        the layer's all-reduce sums with the base output's)."""
        adapter = read_adapter(path, self.linears, self.max_rank, self.dtype)
        if not self.splits:
            return adapter
        updates = {}
        for module, update in adapter.updates.items():
            split = self.splits.get(module)
            if split is not None:
                side, rank, size = split
                if side == "out":
                    n = update.b.shape[0] // size
                    update = dataclasses.replace(update, b=update.b[rank * n : (rank + 1) * n].contiguous())
                else:
                    n = update.a.shape[1] // size
                    update = dataclasses.replace(
                        update, a=update.a[:, rank * n : (rank + 1) * n].contiguous()
                    )
            updates[module] = update
        return dataclasses.replace(adapter, updates=updates)

    def follow(self, slot_rows: torch.Tensor, placements: Sequence[tuple[int, int, str]]) -> LoraStep:
        """A tensor-parallel worker's step: rank 0's slots as it placed them (``placements``:
        (slot, adapter uid, path) of every slot the step uses), each new one read from its
        path and written at once, then the step's rows by slot."""
        for slot, uid, path in placements:
            held = self.slots[slot]
            if held is None or held.uid != uid:
                loaded = LoadedAdapter(f"rank-0-adapter-{uid}", uid, uid, self._read(path), pinned=False)
                for write in self._slot_writes(slot, loaded):
                    write()
        return LoraStep.build(
            slot_rows, self.max_loras, self.max_rank, self.dtype, self.device, self._experts
        )

    def step(
        self, adapters: Sequence[LoadedAdapter | None], lengths: Sequence[int], rows: int
    ) -> LoraStep | None:
        """The step's mask: chunk ``i`` has ``lengths[i]`` rows with ``adapters[i]`` (None:
        the base model), in order, then padding up to ``rows``. None when no row has one.
        Slots given to new adapters are filled when the step runs (``LoraStep.write_slots``)."""
        if all(a is None for a in adapters):
            return None
        distinct = list(dict.fromkeys(a for a in adapters if a is not None))
        if len(distinct) > self.max_loras:
            raise RuntimeError(f"a step holds {len(distinct)} adapters; max_loras is {self.max_loras}")
        keep: set[int] = {self.slots.index(a) for a in distinct if a in self.slots}
        slot_of = {}
        for loaded in distinct:
            slot_of[loaded] = self._place(loaded, keep)
            keep.add(slot_of[loaded])
        fills = tuple(
            functools.partial(self._fill, slot, *self._placed[slot])
            for slot in sorted(slot_of.values())
            if slot in self._placed and self._applied.get(slot, 0) < self._placed[slot][0]
        )
        per_chunk = torch.tensor([-1 if a is None else slot_of[a] for a in adapters], dtype=torch.long)
        slot_rows = torch.full((rows,), -1, dtype=torch.long)
        used = sum(lengths)
        slot_rows[:used] = per_chunk.repeat_interleave(torch.tensor(list(lengths), dtype=torch.long))
        placements = tuple((slot, a.uid, str(a.adapter.path)) for a, slot in slot_of.items())
        return LoraStep.build(
            slot_rows,
            self.max_loras,
            self.max_rank,
            self.dtype,
            self.device,
            self._experts,
            fills,
            placements,
        )

    def _fill(self, slot: int, version: int, writes: list[Callable[[], None]]) -> None:
        """Write placement ``version`` into ``slot``'s tensors unless they hold it or a later one."""
        with self._fill_lock:
            if self._applied.get(slot, 0) >= version:
                return
            for write in writes:
                write()
            self._applied[slot] = version

    def running(self, adapters: Sequence[LoadedAdapter | None]) -> list[str]:
        """The distinct adapter names among ``adapters`` (a metric's view of running requests)."""
        return list(dict.fromkeys(a.name for a in adapters if a is not None))


def _whole_shape(target: Target, split: tuple[str, int, int] | None) -> tuple[int, int]:
    """(in, out) features of a target linear as the checkpoint has it, before any cut."""
    if split is None:
        return target.in_features, target.out_features
    side, _, size = split
    if side == "out":
        return target.in_features, target.out_features * size
    return target.in_features * size, target.out_features


def adapter_for(registry: LoraRegistry | None, lora_request: object) -> LoadedAdapter | None:
    """The adapter a new request runs with (None: the base model); ``ValueError`` when it
    names one and the engine serves none."""
    if lora_request is None:
        return None
    if registry is None:
        raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora=True)")
    return registry.resolve(lora_request)
