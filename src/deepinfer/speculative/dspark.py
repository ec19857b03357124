"""The DSpark drafter of V4.1 (DSpark paper §2.2-§3.1 and §3.2.1; the official
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
distribution exactly the target's. The stages' math is ``models.dspark_stages.DSparkDraftModel``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.speculative.draft_ring import DraftRing, kept_rows
from deepinfer.speculative.drafter import Draft, DraftRequest, sample_drafts


class DSparkModel(Protocol):
    """What the DSpark drafter runs (``deepinfer.models.dspark_stages.DSparkDraftModel``)."""

    block_size: int
    noise_token_id: int
    window: int
    kv_dim: int
    num_stages: int
    dtype: torch.dtype
    device: torch.device
    # the target layers whose entering hidden states it reads (empty: the target's own choice)
    feature_layers: tuple[int, ...]
    # a draft vocabulary: the token id of each column ``logits`` gives (None: every token)
    vocab: torch.Tensor | None
    vocab_size: int

    def window_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def block_hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, windows: list[torch.Tensor], visible: torch.Tensor
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def confidence(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor: ...


class DSparkDrafter:
    """A ``Drafter`` over V4.1's DSpark stages: a window ring per stage and slot, one block
    forward per proposal, drafts sampled left to right with the Markov bias, and the
    confidence head's per-position scores for the verification schedule."""

    def __init__(self, draft: DSparkModel, num_slots: int, num_speculative_tokens: int | None) -> None:
        """``num_speculative_tokens``: drafts per proposal, at most the block (None: the block)."""
        self.draft = draft
        self.block_size = draft.block_size
        if num_speculative_tokens is not None and num_speculative_tokens > self.block_size:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={num_speculative_tokens} exceeds the DSpark "
                f"block of this checkpoint (dspark_block_size={self.block_size})"
            )
        self.num_draft_tokens = num_speculative_tokens or self.block_size
        self.window = draft.window
        self.feature_layers = draft.feature_layers
        self.ring = DraftRing(
            draft.num_stages, num_slots, self.window, draft.kv_dim, draft.dtype, draft.device
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
        self.ring.write(slot_t, pos, self.draft.window_kv(features[rows], pos))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        draft, g = self.draft, self.block_size
        dev = self.ring.kv.device
        b = len(requests)
        anchors = torch.tensor([r.anchor_token for r in requests], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.anchor_pos for r in requests], dtype=torch.long, device=dev)
        slots = torch.tensor([r.slot for r in requests], dtype=torch.long, device=dev)
        ids = torch.full((b, g), draft.noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        positions = (anchor_pos.unsqueeze(1) + torch.arange(g, device=dev)).flatten()
        visible = self.ring.visible(slots, anchor_pos - self.window, anchor_pos - 1)
        windows = [self.ring.read(s, slots) for s in range(draft.num_stages)]
        hidden = draft.block_hidden(ids.flatten(), positions, windows, visible)  # [B * g, d]
        logits = draft.logits(hidden).view(b, g, -1)
        prev = anchors
        tokens, qs, embeds = [], [], []
        vocab = draft.vocab  # a draft vocabulary: the logits' columns are its tokens
        for i in range(self.num_draft_tokens):
            bias, embed = draft.markov(prev)
            logits[:, i] += bias
            prev, q = sample_drafts(logits[:, i], requests)
            if vocab is not None:
                prev = vocab[prev]
                q = [None if row is None else full_distribution(row, vocab, draft.vocab_size) for row in q]
            tokens.append(prev)
            qs.append(q)
            embeds.append(embed)
        k = self.num_draft_tokens
        conf = draft.confidence(hidden.view(b, g, -1)[:, :k], torch.stack(embeds, dim=1))  # [B, k]
        drafted = torch.stack(tokens, dim=1).tolist()
        confidences = conf.tolist()
        out = []
        for i, r in enumerate(requests):
            q_rows = None if r.params.greedy else torch.stack([qs[j][i] for j in range(k)])
            out.append(Draft(r.anchor_pos, drafted[i], q_rows, confidences[i]))
        return out


def full_distribution(q: torch.Tensor, vocab: torch.Tensor, size: int) -> torch.Tensor:
    """A draft distribution over ``vocab``'s tokens as one over the whole vocabulary."""
    return torch.zeros(size, dtype=q.dtype, device=q.device).index_copy_(0, vocab, q)
