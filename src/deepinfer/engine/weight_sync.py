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

from typing import TYPE_CHECKING

import torch

from deepinfer.engine.scheduler import Scheduler
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.projection import Projection, projections

if TYPE_CHECKING:
    from deepinfer.engine.engine import Engine


class WeightSync:
    """Which parameters (and persistent buffers) the model has, the version and address each
    had when the engine's copies were last made, and the ``weight_version`` outputs carry."""

    def __init__(self, model: CausalLM, follow: bool) -> None:
        """``follow``: check the parameters before every step (an engine over a trainer's
        module, ``LLM.from_model``); otherwise only when an update is announced."""
        self.model = model
        self.follow = follow
        # parameters and persistent buffers (routing tables): what a checkpoint holds
        named = [(n, p) for n, p in model.state_dict(keep_vars=True).items() if not p.is_meta]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.by_param: dict[int, list[Projection]] = {}
        for projection in projections(model):
            for source in projection.sources():
                self.by_param.setdefault(id(source), []).append(projection)
        self.seen = self._state()
        self.updates = 0
        self.version = "0"

    def _state(self) -> list[tuple[int, int]]:
        return [(p._version, p.data_ptr()) for p in self.params]

    def changed(self) -> list[int]:
        """Indices of the parameters written (or replaced) since the copies were made."""
        now = self._state()
        return [i for i, (a, b) in enumerate(zip(now, self.seen, strict=True)) if a != b]

    def before_step(self, engine: Engine) -> None:
        """A following engine's check: apply whatever the trainer wrote since the last step."""
        if self.follow:
            changed = self.changed()
            if changed:
                self.apply(engine, changed)

    def apply(self, engine: Engine, changed: list[int] | None = None, version: str | None = None) -> bool:
        """Remake the copies of the written parameters (all of them when ``changed`` is None),
        preempt what runs and forget the prefix cache; the weight version moves on (to
        ``version`` when given). Returns whether anything was written."""
        changed = self.changed() if changed is None else changed
        if not changed and version is None:
            return False
        if engine._inflight is not None:
            raise RuntimeError(
                "weights cannot change while an asynchronous step is in flight; let the requests "
                "finish, or run the engine with async_scheduling=False"
            )
        now = self._state()
        replaced = [self.names[i] for i in changed if now[i][1] != self.seen[i][1]]
        if replaced:
            raise RuntimeError(
                f"parameter {replaced[0]!r} was replaced by new storage; the engine reads parameters "
                "where they are: write new values in place (param.copy_(new), optimizer steps) or "
                "pass them to LLM.update_weights"
            )
        forget_computed_cache(engine)
        stale: dict[int, Projection] = {}
        for i in changed:
            for projection in self.by_param.get(id(self.params[i]), ()):
                stale[id(projection)] = projection
        for projection in stale.values():
            projection.refresh()
        if engine.registers_packed:  # the compiled op's registry checks versions; pack again
            self.model.register_packed_projections()
        self.seen = self._state()
        self.updates += 1
        self.version = version if version is not None else str(self.updates)
        return True

    def refresh_all(self) -> None:
        """Remake every derived copy (after their memory was given back, ``sleep(level=2)``)."""
        for projection in projections(self.model):
            projection.refresh()


def forget_computed_cache(engine: Engine) -> None:
    """Every running request computes again from its first token and no cached prefix is
    reused: the K/V the old weights wrote is never read again."""
    sched = engine.scheduler
    for rank in sched.ranks if not isinstance(sched, Scheduler) else [sched]:
        for request in list(rank.running):
            rank.preempt(request)
        if rank.tier_hits is not None:
            rank.tier_hits.drop_loads(rank.waiting, rank._release)
            rank.tier_hits.tiers.weights_changed()
    for pool in [*engine.pools, *(engine.window_pools or [])]:
        pool.reset_prefix_cache()
    if engine.executor.routing is not None:
        engine.executor.routing.forget()


@torch.no_grad()
def write_parameters(targets: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each new value into its parameter, in place."""
    for target, value in targets:
        target.copy_(value)
