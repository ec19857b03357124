"""The DSpark draft stages of V4.1 (``mtp.0..k-1`` in the checkpoint; the official
``DSparkBlock`` / ``DSparkAttention`` / ``Transformer.forward_spec``).

Each stage is a sliding-window-only V4.1 block with its own smaller MoE. Stage 0 also projects
the target layers' input means (``main_proj``, ``main_norm``); the last stage carries the final
``norm``, the Markov head (a rank-``dspark_markov_rank`` bigram logit bias) and the confidence
head. The stages share ``embed`` and ``head`` with the backbone; ``DSparkDraftModel`` joins
them for the drafter (``deepinfer.speculative.dspark``), which owns the per-sequence window
rings and the sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v41_blocks import LaggedBlock, first_site_pre_mix, moe_config_for_dspark
from deepinfer.models.deepseek_v41_config import DeepseekV41Config, LayerRole
from deepinfer.models.layers.mhc import hc_collapse, hc_expand
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary


class MarkovHead(nn.Module):
    """A low-rank bigram model: previous token -> rank-r embedding -> logit bias."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """Scores how likely a drafted position is to be accepted (fp32 linear to one logit)."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, 1, bias=False)


class DSparkStage(LaggedBlock):
    """Stage ``k`` of ``n``: a window-only V4.1 block (the one-site mHC lag included), plus
    the feature projection on the first stage and the output heads on the last."""

    def __init__(self, cfg: DeepseekV41Config, k: int, main_rope: Rotary) -> None:
        window_only = LayerRole(cfg.num_hidden_layers + k, 0, None, None, False, False, False)
        super().__init__(cfg, window_only, main_rope, main_rope, 0, moe_config_for_dspark(cfg))
        h, last = cfg.hidden_size, cfg.num_nextn_predict_layers - 1
        self.main_proj: nn.Linear | None = None
        self.main_norm: RMSNorm | None = None
        if k == 0:
            self.main_proj = nn.Linear(h * len(cfg.dspark_target_layer_ids), h, bias=False)
            self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm: RMSNorm | None = None
        self.markov_head: MarkovHead | None = None
        self.confidence_head: ConfidenceHead | None = None
        if k == last:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(h + cfg.dspark_markov_rank)

    def window_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The K=V vector [N, D] of an accepted row, from the projected target features."""
        cos, sin = self.attn.rotary(positions)
        return self.attn.latent_kv(main_x, cos, sin)

    def forward(  # type: ignore[override]  (a draft block, not a backbone layer)
        self,
        streams: torch.Tensor,
        pre_mix: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor],
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of B blocks of ``block_size`` tokens ([B * g, n, d]); each row attends to its
        sequence's ``window`` (ring rows [B, W, D] and their visibility [B, W]) and to its
        whole block (no causal mask inside it). Returns (streams, the FFN site's pre mix)."""
        g = block_size
        attn_pre, post, comb = self.mixes(streams, "attn")
        x = self.attn_norm(hc_collapse(streams, pre_mix))
        q, _, cos, sin = self.attn.queries(x, positions)
        kv = self.attn.latent_kv(x, cos, sin)
        b = kv.shape[0] // g
        block_kv = kv.view(b, g, -1).repeat_interleave(g, dim=0)  # every row sees its block
        in_block = torch.ones(b * g, g, dtype=torch.bool, device=kv.device)
        ring, visible = window
        ring = ring.to(kv.dtype).repeat_interleave(g, dim=0)
        y = self.attn.attend(q, [(ring, visible.repeat_interleave(g, dim=0)), (block_kv, in_block)], cos, sin)
        streams = hc_expand(y, streams, post, comb)
        ffn_pre, post, comb = self.mixes(streams, "ffn")
        y = self.ffn(self.ffn_norm(hc_collapse(streams, attn_pre)), ids)
        return hc_expand(y, streams, post, comb), ffn_pre


def build_dspark_stages(cfg: DeepseekV41Config, main_rope: Rotary) -> nn.ModuleList:
    """The ``mtp`` stages (empty when the config has no DSpark head)."""
    n = cfg.num_nextn_predict_layers
    if not n or not cfg.dspark_block_size:
        return nn.ModuleList()
    return nn.ModuleList(DSparkStage(cfg, k, main_rope) for k in range(n))


class DSparkDraftModel:
    """The DSpark stages with the backbone's embedding and head: every computation the DSpark
    drafter runs, none of its bookkeeping (rings, sampling)."""

    def __init__(
        self, stages: nn.ModuleList, embed: nn.Embedding, head: nn.Linear, cfg: DeepseekV41Config
    ) -> None:
        self.stages = stages
        self.embed, self.head = embed, head
        self.hc_mult = cfg.hc_mult
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.window = cfg.sliding_window
        self.kv_dim = cfg.head_dim
        self.dtype = embed.weight.dtype
        self.device = embed.weight.device
        self.feature_layers: tuple[int, ...] = ()  # the backbone reads dspark_target_layer_ids itself
        self.vocab: torch.Tensor | None = None  # drafts over the whole vocabulary
        self.vocab_size = cfg.vocab_size

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def window_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every stage's K=V vectors [stages, N, D] of accepted rows from the target's
        features (the mean stream entering each ``dspark_target_layer_ids`` layer)."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(features.to(self.dtype)))
        return torch.stack([stage.window_kv(main_x, positions) for stage in self.stages])

    def block_hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        windows: list[torch.Tensor],
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Run blocks ``[anchor, noise x (g - 1)]`` (flat ids [B * g]) through the stages;
        ``windows``: each stage's ring rows [B, W, D]. Returns the hidden rows [B * g, d]."""
        h = self.embed(ids)
        streams = h.unsqueeze(1).expand(h.shape[0], self.hc_mult, h.shape[-1]).contiguous()
        pre_mix = first_site_pre_mix(h.shape[0], self.hc_mult, h.device)
        for stage, ring in zip(self.stages, windows, strict=True):
            streams, pre_mix = stage(streams, pre_mix, ids, positions, (ring, visible), self.block_size)
        return hc_collapse(streams, pre_mix)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden rows (the last stage's norm, the shared head)."""
        return F.linear(self.stages[-1].norm(hidden).float(), self.head.weight.float())

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov head's fp32 logit bias [B, V] after tokens ``prev`` and their rank-r
        embeddings (which the confidence head reads)."""
        markov = self.stages[-1].markov_head
        embed = markov.embed(prev)
        return F.linear(embed.float(), markov.head.weight.float()), embed

    def confidence(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
        """P(draft accepted | the drafts before it were), from ``[h_i ; markov_embed(prev)]``."""
        head_in = torch.cat([hidden, markov_embeds], dim=-1)
        return torch.sigmoid(self.stages[-1].confidence_head.proj(head_in.float()).squeeze(-1))
