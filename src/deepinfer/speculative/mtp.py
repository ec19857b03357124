"""The MTP drafter of V4 (its next-n layer ``mtp.0``; techniques.md §1.5).

Row t of the MTP layer reads the backbone's final streams at position t and the embedding of
token t + 1 (``MtpBlock.merge_input``) and predicts token t + 2. After the target accepted
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

import torch

from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.layers.mhc import hc_collapse, hc_expand, hc_head_collapse
from deepinfer.speculative.draft_ring import DraftRing, kept_rows
from deepinfer.speculative.drafter import Draft, DraftRequest, sample_drafts


class MtpDrafter:
    def __init__(self, model: DeepseekV4ForCausalLM, num_slots: int, num_speculative_tokens: int) -> None:
        if not len(getattr(model, "mtp", ())):
            raise ValueError(
                "speculative.method='mtp' needs a V4 checkpoint with its MTP layer (mtp.0.*; "
                "num_nextn_predict_layers >= 1 in config.json)"
            )
        cfg = model.config
        self.model = model
        self.layer = model.mtp[0]
        self.num_draft_tokens = num_speculative_tokens
        self.window = cfg.sliding_window
        dev = next(model.parameters()).device
        dtype = model.compute_dtype
        self.ring = DraftRing(1, num_slots, self.window, cfg.head_dim, dtype, dev)
        self.last_streams = torch.zeros(num_slots, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=dev)
        self.last_pos = [-1] * num_slots

    @property
    def cache_bytes(self) -> int:
        """Memory of the drafter's per-slot state."""
        return self.ring.nbytes + self.last_streams.numel() * self.last_streams.element_size()

    def claim(self, slot: int, request_id: str) -> None:
        if self.ring.owner[slot] != request_id:
            self.last_pos[slot] = -1
        self.ring.claim(slot, request_id)

    def _input(self, streams: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self.layer.merge_input(self.model.embed(next_tokens), streams)

    @torch.inference_mode()
    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        kept = kept_rows(slots, positions, self.window, features.device)
        if kept is None:
            return
        rows, slot_t, pos = kept
        cfg = self.model.config
        streams = features[rows].view(-1, cfg.hc_mult, cfg.hidden_size).to(self.model.compute_dtype)
        nxt = torch.tensor(next_tokens, dtype=torch.long, device=features.device)[rows]
        x = self._input(streams, nxt)
        pre, _, _ = self.layer.mixes(x, "attn")
        attn_in = self.layer.attn_norm(hc_collapse(x, pre))
        cos, sin = self.layer.attn.rotary(pos)
        kv = self.layer.attn.latent_kv(attn_in, cos, sin)
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
        cfg, layer = self.model.config, self.layer
        dev = self.last_streams.device
        slots = torch.tensor([r.slot for r in requests], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.anchor_pos for r in requests], dtype=torch.long, device=dev)
        streams = self.last_streams[slots]
        token = torch.tensor([r.anchor_token for r in requests], dtype=torch.long, device=dev)
        ring = self.ring.read(0, slots)
        local: list[torch.Tensor] = []  # K=V of this proposal's earlier rows (never stored)
        tokens, qs = [], []
        for i in range(self.num_draft_tokens):
            pos = anchor_pos - 1 + i
            x = self._input(streams, token)
            pre, post, comb = layer.mixes(x, "attn")
            attn_in = layer.attn_norm(hc_collapse(x, pre))
            q, _, cos, sin = layer.attn.queries(attn_in, pos)
            kv = layer.attn.latent_kv(attn_in, cos, sin)
            if i == 0:  # row P - 1 is accepted: its K=V is already in the ring
                parts = [(ring.to(kv.dtype), self.ring.visible(slots, pos - self.window + 1, pos))]
            else:  # ring entries up to P - 1 still inside this row's window, then the draft rows
                local.append(kv)
                visible = self.ring.visible(slots, pos - self.window + 1, anchor_pos - 1)
                drafts_kv = torch.stack(local, dim=1)
                own = torch.ones(drafts_kv.shape[:2], dtype=torch.bool, device=dev)
                parts = [(ring.to(kv.dtype), visible), (drafts_kv, own)]
            y = layer.attn.attend(q, parts, cos, sin)
            x = hc_expand(y, x, post, comb)
            pre, post, comb = layer.mixes(x, "ffn")
            y = layer.ffn(layer.ffn_norm(hc_collapse(x, pre)), token)
            streams = hc_expand(y, x, post, comb)
            head_in = hc_head_collapse(
                streams,
                layer.hc_head_fn,
                layer.hc_head_base,
                layer.hc_head_scale,
                hc_eps=cfg.hc_eps,
                norm_eps=cfg.rms_norm_eps,
            )
            logits = self.model.head(layer.norm(head_in)).float()
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
