"""The MTP drafter of V4 (its next-n layer ``mtp.0``).

Row t of the MTP layer reads the backbone's final streams at position t and the embedding of
token t + 1 (``MtpBlock.merge_input``; the layer's math is ``models.deepseek_v4.MtpDraftModel``) and predicts token t + 2. After the target accepted
positions ``< P`` (the anchor, the newest token, at ``P``):

- ``observe``: every accepted row t stores the MTP layer's K=V vector (a row-wise projection
  of its input) at position t in the layer's private window ring; the streams of the newest
  row per sequence are kept for the next proposal;
- ``propose``: row ``P - 1`` (streams of ``P - 1``, token ``P``) runs the whole block, its
  window attention over ring positions ``[P - W, P - 1]``, then the layer's ``hc_head``, norm
  and the shared head; draft 1 is sampled. For k > 1 the next row takes the previous row's
  output streams and the draft just sampled, attending to the ring and to the earlier draft
  rows (kept out of the ring: only accepted positions are stored).

Production V4 ran MTP-1 (one draft, verify two tokens); MTP-3/5 lose throughput at high
concurrency (DSpark paper §5.4), so ``method="mtp"`` defaults to one draft.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.speculative.draft_ring import DraftRing, kept_rows
from deepinfer.speculative.drafter import Draft, DraftRequest, sample_drafts


class MtpModel(Protocol):
    """What the MTP drafter runs (``deepinfer.models.deepseek_v4.MtpDraftModel``)."""

    window: int
    kv_dim: int
    hc_mult: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def window_kv(
        self, streams: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor: ...

    def draft_row(
        self,
        streams: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor],
        earlier: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class MtpDrafter:
    """A ``Drafter`` over V4's MTP layer: a window ring of the layer's K=V per slot and the
    newest accepted row's streams, from which each proposal chains ``num_draft_tokens`` rows."""

    feature_layers: tuple[int, ...] = ()  # the model's own features (its final streams)

    def __init__(self, draft: MtpModel, num_slots: int, num_speculative_tokens: int) -> None:
        self.draft = draft
        self.num_draft_tokens = num_speculative_tokens
        self.window = draft.window
        dev, dtype = draft.device, draft.dtype
        self.ring = DraftRing(1, num_slots, self.window, draft.kv_dim, dtype, dev)
        self.last_streams = torch.zeros(num_slots, draft.hc_mult, draft.hidden_size, dtype=dtype, device=dev)
        self.last_pos = [-1] * num_slots

    @property
    def cache_bytes(self) -> int:
        """Memory of the drafter's per-slot state."""
        return self.ring.nbytes + self.last_streams.numel() * self.last_streams.element_size()

    def claim(self, slot: int, request_id: str) -> None:
        if self.ring.owner[slot] != request_id:
            self.last_pos[slot] = -1
        self.ring.claim(slot, request_id)

    @torch.inference_mode()
    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        kept = kept_rows(slots, positions, self.window, features.device)
        if kept is None:
            return
        rows, slot_t, pos = kept
        draft = self.draft
        streams = features[rows].view(-1, draft.hc_mult, draft.hidden_size).to(draft.dtype)
        nxt = torch.tensor(next_tokens, dtype=torch.long, device=features.device)[rows]
        kv = draft.window_kv(streams, nxt, pos)
        self.ring.write(slot_t, pos, kv.unsqueeze(0))
        for j, (slot, p) in enumerate(zip(slot_t.tolist(), pos.tolist(), strict=True)):
            if p >= self.last_pos[slot]:  # the newest row per slot feeds the next proposal
                self.last_pos[slot] = p
                self.last_streams[slot] = streams[j]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        ready = [r for r in requests if self.last_pos[r.slot] == r.anchor_pos - 1]
        drafts = {id(r): d for r, d in zip(ready, self._propose(ready), strict=True)}
        return [drafts.get(id(r), Draft(r.anchor_pos, [], None, [])) for r in requests]

    def _propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        dev = self.last_streams.device
        slots = torch.tensor([r.slot for r in requests], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.anchor_pos for r in requests], dtype=torch.long, device=dev)
        streams = self.last_streams[slots]
        token = torch.tensor([r.anchor_token for r in requests], dtype=torch.long, device=dev)
        ring = self.ring.read(0, slots)
        earlier: list[torch.Tensor] = []  # K=V of this proposal's draft rows (never stored)
        tokens, qs = [], []
        for i in range(self.num_draft_tokens):
            pos = anchor_pos - 1 + i
            if i == 0:  # row P - 1 is accepted: its K=V is already in the ring
                visible = self.ring.visible(slots, pos - self.window + 1, pos)
                logits, streams, _ = self.draft.draft_row(streams, token, pos, (ring, visible), None)
            else:  # ring entries up to P - 1 still inside this row's window, then the draft rows
                visible = self.ring.visible(slots, pos - self.window + 1, anchor_pos - 1)
                logits, streams, kv = self.draft.draft_row(streams, token, pos, (ring, visible), earlier)
                earlier.append(kv)
            token, q_row = sample_drafts(logits, requests)
            tokens.append(token)
            qs.append(q_row)
        drafted = torch.stack(tokens, dim=1).tolist()
        out = []
        for i, r in enumerate(requests):
            q_rows = (
                None if r.params.greedy else torch.stack([qs[j][i] for j in range(self.num_draft_tokens)])
            )
            out.append(Draft(r.anchor_pos, drafted[i], q_rows, []))
        return out
