"""The private sliding-window K=V cache of a model drafter (DSpark stages, V4's MTP layer).

A draft layer attends only to the last ``window`` positions, so each sequence slot keeps a
ring of ``window`` vectors per draft layer at ``position % window`` (the layout of the
official DSpark attention's ``window_kv_cache`` and of the community vLLM port's per-request
ring), not pages of the target's paged cache. Only positions whose tokens
the target has accepted are written, so a rejected draft leaves nothing to roll back; each
entry remembers its position, so stale or missing entries (a slot reused by another request,
a prefix-cache hit whose tokens never ran the target) are masked out instead of read.
"""

from __future__ import annotations

import torch


class DraftRing:
    def __init__(
        self, num_layers: int, num_slots: int, window: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if window < 1:
            raise ValueError(f"a draft ring needs a window of at least 1 position, got {window}")
        self.window = window
        self.kv = torch.zeros(num_layers, num_slots, window, dim, dtype=dtype, device=device)
        self.pos = torch.full((num_slots, window), -1, dtype=torch.long, device=device)
        self.owner: list[str | None] = [None] * num_slots

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.pos.numel() * self.pos.element_size()

    def claim(self, slot: int, request_id: str) -> None:
        """Give ``slot`` to ``request_id``; a new owner starts with an empty ring."""
        if self.owner[slot] != request_id:
            self.owner[slot] = request_id
            self.pos[slot] = -1

    def write(self, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` [layers, N, D] at the rows' positions. At most ``window`` positions per
        slot per call (more would collide in the ring; callers keep the latest)."""
        ring = positions % self.window
        self.kv[:, slots, ring] = kv.to(self.kv.dtype)
        self.pos[slots, ring] = positions

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The ring [B, window, D] of each slot for one draft layer."""
        return self.kv[layer, slots]

    def visible(self, slots: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """[B, window] bool: entries holding a position in ``[lo, hi]`` (per row)."""
        pos = self.pos[slots]
        return (pos >= 0) & (pos >= lo.unsqueeze(1)) & (pos <= hi.unsqueeze(1))


def latest_rows(slots: list[int], positions: list[int], window: int) -> list[int]:
    """Indices of the rows to store: per slot, only positions within ``window`` of its largest
    (earlier ones would land on the same ring entries and could never be read)."""
    top: dict[int, int] = {}
    for s, p in zip(slots, positions, strict=True):
        top[s] = max(top.get(s, p), p)
    return [i for i, (s, p) in enumerate(zip(slots, positions, strict=True)) if p > top[s] - window]


def kept_rows(
    slots: list[int], positions: list[int], window: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``latest_rows`` as tensors on ``device``: (row indices, their slots, their positions),
    or None when there is nothing to store."""
    keep = latest_rows(slots, positions, window)
    if not keep:
        return None
    rows = torch.tensor(keep, dtype=torch.long, device=device)
    return (
        rows,
        torch.tensor([slots[i] for i in keep], dtype=torch.long, device=device),
        torch.tensor([positions[i] for i in keep], dtype=torch.long, device=device),
    )
