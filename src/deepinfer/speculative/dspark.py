"""The DSpark drafter of V4.1 (model_spec.md §2.8; techniques.md §1.1-§1.2; the official
``DSparkBlock`` / ``DSparkAttention`` / ``Transformer.forward_spec``).

Per sequence, after the target accepted positions ``< P``, with the newest token (the
anchor) at position ``P``:

1. the target's features of accepted rows (the mean stream entering each of
   ``dspark_target_layer_ids``, concatenated) go through ``main_proj`` + ``main_norm``; each
   stage projects them to its K=V vector (``wkv``, ``kv_norm``, RoPE at the row's position)
   into the stage's private window ring (``observe``);
2. one forward of the block ``[anchor, noise x (g - 1)]`` at positions ``P .. P+g-1`` through
   the stages (V4.1 blocks with the one-site mHC lag; window-only attention over the ring's
   positions ``[P - W, P - 1]`` plus the whole block, no causal mask inside it; their own MoE);
3. the last stage's norm and the shared head give ``g`` rows of logits; left to right, row i
   adds the Markov bigram bias of the previous token (the anchor for row 0) and samples draft
   i; the confidence head scores ``[h_i ; markov_embed(prev)]`` (sigmoid: the chance draft i
   survives given the ones before it did).

All sequences of a step run as one batch. Drafts are sampled with the request's own filters
and generator, and their distributions go to verification, so any draft keeps the output
distribution exactly the target's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM, first_site_pre_mix
from deepinfer.models.layers.mhc import hc_collapse, hc_expand
from deepinfer.speculative.draft_ring import DraftRing, kept_rows
from deepinfer.speculative.drafter import Draft, DraftRequest, sample_drafts


class DSparkDrafter:
    def __init__(
        self, model: DeepseekV41ForCausalLM, num_slots: int, num_speculative_tokens: int | None
    ) -> None:
        """``num_speculative_tokens``: drafts per proposal, at most the block (None: the block)."""
        cfg = model.config
        if not len(model.mtp):
            raise ValueError(
                "speculative.method='dspark' needs the checkpoint's DSpark stages (mtp.*; "
                "num_nextn_predict_layers and dspark_block_size in config.json)"
            )
        self.model = model
        self.stages = model.mtp
        self.block_size = cfg.dspark_block_size
        self.noise_token = cfg.dspark_noise_token_id
        if num_speculative_tokens is not None and num_speculative_tokens > self.block_size:
            raise ValueError(
                f"speculative.num_speculative_tokens={num_speculative_tokens} exceeds the DSpark "
                f"block of this checkpoint (dspark_block_size={self.block_size})"
            )
        self.num_draft_tokens = num_speculative_tokens or self.block_size
        self.window = cfg.sliding_window
        p = next(model.parameters())
        self.ring = DraftRing(
            len(self.stages), num_slots, self.window, cfg.head_dim, model.compute_dtype, p.device
        )

    @property
    def cache_bytes(self) -> int:
        """Memory of the drafter's per-slot state."""
        return self.ring.nbytes

    def claim(self, slot: int, request_id: str) -> None:
        self.ring.claim(slot, request_id)

    @torch.inference_mode()
    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        kept = kept_rows(slots, positions, self.window, features.device)
        if kept is None:
            return
        rows, slot_t, pos = kept
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(features[rows].to(self.model.compute_dtype)))
        kvs = []
        for stage in self.stages:
            cos, sin = stage.attn.rotary(pos)
            kvs.append(stage.attn.latent_kv(main_x, cos, sin))
        self.ring.write(slot_t, pos, torch.stack(kvs))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        cfg, g = self.model.config, self.block_size
        dev = self.ring.kv.device
        b = len(requests)
        anchors = torch.tensor([r.anchor_token for r in requests], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.anchor_pos for r in requests], dtype=torch.long, device=dev)
        slots = torch.tensor([r.slot for r in requests], dtype=torch.long, device=dev)
        ids = torch.full((b, g), self.noise_token, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = (anchor_pos.unsqueeze(1) + torch.arange(g, device=dev)).flatten()
        h = self.model.embed(ids)
        streams = h.unsqueeze(1).expand(h.shape[0], cfg.hc_mult, h.shape[-1]).contiguous()
        pre_mix = first_site_pre_mix(h.shape[0], cfg.hc_mult, dev)
        ring_visible = self.ring.visible(slots, anchor_pos - self.window, anchor_pos - 1)
        ring_visible = ring_visible.repeat_interleave(g, dim=0)
        in_block = torch.ones(b * g, g, dtype=torch.bool, device=dev)
        for s, stage in enumerate(self.stages):
            attn_pre, post, comb = stage.mixes(streams, "attn")
            x = stage.attn_norm(hc_collapse(streams, pre_mix))
            q, _, cos, sin = stage.attn.queries(x, positions)
            kv = stage.attn.latent_kv(x, cos, sin)
            block_kv = kv.view(b, g, -1).repeat_interleave(g, dim=0)  # every row sees its block
            window = self.ring.read(s, slots).to(kv.dtype).repeat_interleave(g, dim=0)
            y = stage.attn.attend(q, [(window, ring_visible), (block_kv, in_block)], cos, sin)
            streams = hc_expand(y, streams, post, comb)
            ffn_pre, post, comb = stage.mixes(streams, "ffn")
            y = stage.ffn(stage.ffn_norm(hc_collapse(streams, attn_pre)), ids)
            streams, pre_mix = hc_expand(y, streams, post, comb), ffn_pre
        last = self.stages[-1]
        hidden = hc_collapse(streams, pre_mix)  # [B * g, d]
        logits = F.linear(last.norm(hidden).float(), self.model.head.weight.float()).view(b, g, -1)
        markov = last.markov_head
        prev = anchors
        tokens, qs, embeds = [], [], []
        for i in range(self.num_draft_tokens):
            embed = markov.embed(prev)
            logits[:, i] += F.linear(embed.float(), markov.head.weight.float())
            prev, q = sample_drafts(logits[:, i], requests)
            tokens.append(prev)
            qs.append(q)
            embeds.append(embed)
        k = self.num_draft_tokens
        head_in = torch.cat([hidden.view(b, g, -1)[:, :k], torch.stack(embeds, dim=1)], dim=-1)
        conf = torch.sigmoid(last.confidence_head.proj(head_in.float()).squeeze(-1))  # [B, k]
        drafted = torch.stack(tokens, dim=1).tolist()
        confidences = conf.tolist()
        out = []
        for i, r in enumerate(requests):
            q_rows = None if r.params.greedy else torch.stack([qs[j][i] for j in range(k)])
            out.append(Draft(r.anchor_pos, drafted[i], q_rows, confidences[i]))
        return out
