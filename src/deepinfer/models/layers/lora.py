"""The low-rank terms of served LoRA adapters, as the layers compute them in a step.

``LoraStep`` is the running step's per-row slot mask, set by the engine around one forward
(``running``) and read by ``Projection``, the hooked linears and the routed experts; outside
a step (research calls, drafters) nothing is set and the base weights alone compute.

A stack holds every slot's A and B of one target. Slot ``s`` owns rank columns
``s * R .. s * R + R`` (``R = max_lora_rank``; a smaller rank is zero-padded). For rows ``x``
[T, in] of a step whose rows use different slots, the term is
``((x @ A_all.T) * mask) @ B_all.T``: one shrink over all slots, the step's per-row slot mask,
one expand, with each slot's scale folded into its B. Mixed adapters and base rows run as one
grouped product (the punica/SGMV idea, as two dense products: with a handful of slots and small
ranks these cost a fraction of the base matmul, and every row is computed the same way
whichever other slots the step holds). Which adapters hold which slots is ``deepinfer.lora``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraStep:
    """``mask`` [T, max_loras * max_rank]: row t is 1 over the rank columns of its request's
    adapter slot and 0 elsewhere (a base-model row is all 0)."""

    mask: torch.Tensor

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The mask for an input of ``x.shape[0]`` rows (the step's tokens)."""
        if x.shape[0] != self.mask.shape[0]:
            raise RuntimeError(
                f"a LoRA target ran on {x.shape[0]} rows in a step of {self.mask.shape[0]} tokens"
            )
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
    their outputs concatenated in that order."""

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
        width = slots * rank
        self.a = torch.zeros(len(outs) * width, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(out, width, dtype=dtype, device=device) for out in outs]
        self.filled = [set[int]() for _ in outs]  # slots holding an update, per linear

    def load(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slot ``slot`` of linear ``index`` takes ``scale * b @ a`` (scale folded into B)."""
        width, r = self.slots * self.rank, a.shape[0]
        first = index * width + slot * self.rank
        with torch.no_grad():
            self.a[first : first + self.rank].zero_()
            self.a[first : first + r].copy_(a)
            self.b[index][:, slot * self.rank : (slot + 1) * self.rank].zero_()
            self.b[index][:, slot * self.rank : slot * self.rank + r].copy_(b * scale)
        self.filled[index].add(slot)

    def clear(self, slot: int) -> None:
        """Slot ``slot`` back to zero in every linear."""
        width = self.slots * self.rank
        with torch.no_grad():
            for index, b in enumerate(self.b):
                if slot in self.filled[index]:
                    first = index * width + slot * self.rank
                    self.a[first : first + self.rank].zero_()
                    b[:, slot * self.rank : (slot + 1) * self.rank].zero_()
                    self.filled[index].discard(slot)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``y`` [T, sum(outs)] plus the rows' low-rank terms (in place; returns ``y``)."""
        if not any(self.filled):
            return y
        width, n = self.slots * self.rank, len(self.outs)
        shrunk = F.linear(x, self.a)  # [T, n * width]
        if n == 1:
            return y.add_(F.linear(shrunk * mask, self.b[0]))
        shrunk = (shrunk.view(-1, n, width) * mask.unsqueeze(1)).view(-1, n * width)
        start = 0
        for index, (out, b) in enumerate(zip(self.outs, self.b, strict=True)):
            if self.filled[index]:
                y[..., start : start + out].add_(F.linear(shrunk[:, index * width : (index + 1) * width], b))
            start += out
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
