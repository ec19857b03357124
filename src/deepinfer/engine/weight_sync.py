"""The engine's weights follow the model's parameters: in-place updates, from a trainer's
optimizer or from ``LLM.update_weights``, reach every form the engine computes with.

The engine computes with derived copies of some parameters: fused projections, copies packed
for the CPU kernels, weight-only int8/int4 copies, and the packed-linear op's registry
(``models/layers/projection.py``, ``kernels/weight_only.py``). Each parameter's PyTorch
version counter says when it was written in place; before a step reads the weights, the
copies made from a written parameter are made again in place, so every address the one-call
decode stack and compiled steps hold stays valid. A parameter replaced by new storage
(``p.data = t``) would leave those addresses behind and is refused by name. Writes PyTorch
does not count (through ``p.data.copy_`` or raw pointers) are not seen; ``LLM.update_weights``
or ``LLM.refresh_weights`` announces them.

After any update the K/V computed under the old weights is of no use: running requests are
preempted (their prompts and tokens so far are computed again under the new weights) and the
prefix cache forgets every block, so no later request reuses a block of the old weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.base import CausalLM
from deepinfer.models.layers.projection import Projection, projections


class WeightSync:
    """Which parameters (and persistent buffers) the model has, the version and address each
    had when the engine's copies were last made, and the ``weight_version`` outputs carry."""

    def __init__(self, model: CausalLM, follow: bool, repack: Callable[[], None] | None = None) -> None:
        """``follow``: check the parameters before every step (an engine over a trainer's
        module, ``LLM.from_model``); otherwise only when an update is announced. ``repack``:
        registers the packed projections again (the compiled CPU op's registry checks
        versions), where the engine uses that registry."""
        self.model = model
        self.follow = follow
        self.repack = repack
        # parameters and persistent buffers (routing tables): what a checkpoint holds
        named = [(n, p) for n, p in model.state_dict(keep_vars=True).items() if not p.is_meta]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.by_param: dict[int, list[Projection]] = {}
        for projection in projections(model):
            for source in projection.sources():
                self.by_param.setdefault(id(source), []).append(projection)
        self.seen = self.state()
        self.updates = 0
        self.version = "0"

    def state(self) -> list[tuple[int, int]]:
        """Each parameter's PyTorch version counter and address now."""
        return [(p._version, p.data_ptr()) for p in self.params]

    def changed(self) -> list[int]:
        """Indices of the parameters written (or replaced) since the copies were made."""
        now = self.state()
        return [i for i, (a, b) in enumerate(zip(now, self.seen, strict=True)) if a != b]

    def check_in_place(self, changed: list[int]) -> None:
        """Refuse, by name, a parameter replaced by new storage: the engine's copies and the
        compiled steps read parameters where they are."""
        now = self.state()
        replaced = [self.names[i] for i in changed if now[i][1] != self.seen[i][1]]
        if replaced:
            raise RuntimeError(
                f"parameter {replaced[0]!r} was replaced by new storage; the engine reads parameters "
                "where they are: write new values in place (param.copy_(new), optimizer steps) or "
                "pass them to LLM.update_weights"
            )

    def refresh(self, changed: list[int], version: str | None = None) -> None:
        """Remake the copies of the written parameters; the weight version moves on (to
        ``version`` when given, else the count of updates)."""
        stale: dict[int, Projection] = {}
        for i in changed:
            for projection in self.by_param.get(id(self.params[i]), ()):
                stale[id(projection)] = projection
        for projection in stale.values():
            projection.refresh()
        if self.repack is not None:
            self.repack()
        self.seen = self.state()
        self.updates += 1
        self.version = version if version is not None else str(self.updates)

    def refresh_all(self, version: str | None = None) -> None:
        """Remake every derived copy (after their memory was given back, ``sleep(level=2)``,
        and the parameters were written again): the weights are those of ``version`` again.
        None: a trainer's own parameters, and a write since the copies were last made is an
        update like any other (the version moves on)."""
        written = bool(self.changed())
        for projection in projections(self.model):
            projection.refresh()
        self.seen = self.state()
        if version is not None:
            self.version = version
        elif written:
            self.updates += 1
            self.version = str(self.updates)


@torch.no_grad()
def write_parameters(targets: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each new value into its parameter, in place."""
    for target, value in targets:
        target.copy_(value)
