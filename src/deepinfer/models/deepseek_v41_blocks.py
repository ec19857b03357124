"""The V4.1 blocks: attention over the KV source's shared compressed entries
(``SharedKVAttention``) and the block with the one-site mHC lag (``LaggedBlock``), shared by
the backbone (``deepseek_v41``) and the DSpark draft stages (``dspark_stages``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.models.deepseek_v41_config import DeepseekV41Config, LayerRole
from deepinfer.models.layers.attention import LatentAttention
from deepinfer.models.layers.compressor import Compressor
from deepinfer.models.layers.engram import (
    Engram,
)
from deepinfer.models.layers.fake_quant import fake_quant_fp4_e4m3_scale
from deepinfer.models.layers.gather import gather_rows
from deepinfer.models.layers.mhc import HyperConnectedBlock, hc_expand
from deepinfer.models.layers.moe import MoE
from deepinfer.models.layers.rope import Rotary
from deepinfer.models.layers.shared_indexer import SharedIndexer, select_candidate_blocks


@dataclass
class StepShared:
    """What earlier layers publish to later ones within one step."""

    # the latest index source's top-k: columns of its ratio's entry_idx, and visibility
    chosen: tuple[torch.Tensor, torch.Tensor] | None = None  # both [T, k]
    candidates: torch.Tensor | None = None  # [T, E] bool: the candidate source's blocks
    # KV source layer -> (its compressed entries, its index keys) as written this step
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class SharedKVAttention(LatentAttention):
    """V4.1 attention: window + the KV source's compressed entries, chosen by the latest
    index source."""

    def __init__(
        self, cfg: DeepseekV41Config, role: LayerRole, main_rope: Rotary, compress_rope: Rotary
    ) -> None:
        super().__init__(
            *LatentAttention.dims(cfg),
            compress_rope if role.ratio else main_rope,
            cfg.fake_quant,
            q_head_norm=False,
        )
        self.role = role
        self.ratio = role.ratio
        self.candidate_topk_blocks, self.candidate_block_size = (
            cfg.candidate_topk_blocks,
            cfg.candidate_block_size,
        )
        owns_kv = role.owns_kv
        self.compressor: Compressor | None = None
        self.indexer: SharedIndexer | None = None
        if owns_kv:
            quantize = fake_quant_fp4_e4m3_scale if cfg.fake_quant else None
            self.compressor = Compressor(
                cfg.hidden_size,
                cfg.head_dim,
                role.ratio,
                overlap=False,
                eps=cfg.rms_norm_eps,
                rotary=compress_rope,
                quantize=quantize,
                position_bias=False,
            )
        if role.scores_topk:
            self.indexer = SharedIndexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                cfg.rms_norm_eps,
                compress_rope,
                cfg.fake_quant,
                key_source_dim=cfg.head_dim if owns_kv else 0,
            )

    def compress(self, x: torch.Tensor, pools: LayerPools, batch: ForwardBatch, shared: StepShared) -> None:
        """KV source only: pool this step's tokens into compressed entries and index keys,
        published in ``shared`` for the layers that read them."""
        assert self.compressor is not None and self.indexer is not None
        assert pools.entries is not None and pools.index_keys is not None
        meta = batch.groups[self.ratio]
        latent, entries = self.compressor(x, pools.compressor, meta, pools.entries, batch)
        keys = pools.index_keys
        if latent is not None:
            keys = self.indexer.write_keys(latent, meta, keys, batch)
        shared.kv[self.role.layer] = (entries, keys)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        pools: LayerPools,
        batch: ForwardBatch,
        shared: StepShared,
        compressed: bool = False,
    ) -> torch.Tensor:
        """``compressed``: this step's entries were already written by ``compress`` (CED)."""
        q, q_residual, cos, sin, window = self.project(x, positions, pools, batch)
        parts = [window]
        if self.ratio:
            meta = batch.groups[self.ratio]
            if self.compressor is not None and not compressed:
                self.compress(x, pools, batch, shared)
            assert self.role.kv_source is not None
            entries, keys = shared.kv[self.role.kv_source]  # written this step by the source
            if self.indexer is not None:
                scores = self.indexer.scores(x, q_residual, cos, sin, keys, meta)
                if self.role.is_candidate_source:
                    shared.candidates = select_candidate_blocks(
                        scores,
                        meta.entry_valid.sum(dim=1),
                        self.candidate_topk_blocks,
                        self.candidate_block_size,
                    )
                elif self.role.uses_candidates:
                    scores = scores.masked_fill(~shared.candidates, float("-inf"))
                shared.chosen = self.indexer.choose(scores)
            assert shared.chosen is not None, "a compressed layer runs after its index source"
            columns, visible = shared.chosen
            rows = meta.entry_idx.gather(1, columns)
            parts.append((gather_rows(entries, rows).to(q.dtype), visible))
        return self.attend(q, parts, cos, sin)


class LaggedBlock(HyperConnectedBlock):
    """A V4.1 block: attention's input is collapsed with the incoming ``pre`` mix (the previous
    block's FFN site), the FFN's with this block's attention-site ``pre``; returns the FFN
    site's ``pre`` for the next block."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        role: LayerRole,
        main_rope: Rotary,
        compress_rope: Rotary,
        engram_rows: int = 0,
        moe_cfg: DeepseekV41Config | None = None,
    ) -> None:
        super().__init__(cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        self.attn = SharedKVAttention(cfg, role, main_rope, compress_rope)
        self.ffn = MoE(moe_cfg or cfg, 0)
        self.engram: Engram | None = None
        if engram_rows:
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            self.engram = Engram(
                cfg.hidden_size, cfg.hc_mult, engram_rows, cfg.engram_head_dim, cols, cfg.rms_norm_eps
            )

    def forward(
        self,
        streams: torch.Tensor,
        pre_mix: torch.Tensor,
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        pools: LayerPools,
        batch: ForwardBatch,
        shared: StepShared,
        compressed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, n, d], pre_mix [T, n] -> (streams, this block's FFN-site pre mix);
        on the research grid [B, S, n, d] and [B, S, n]."""
        streams, pre_mix = batch.to_flat(streams), batch.to_flat(pre_mix)
        x, attn_pre, post, comb = self.pre(streams, "attn", pre_mix)
        y = self.attn(self.attn_norm(x), positions, pools, batch, shared, compressed)
        streams = hc_expand(y, streams, post, comb)
        x, ffn_pre, post, comb = self.pre(streams, "ffn", attn_pre)
        y = self.ffn(self.ffn_norm(x), input_ids, batch.functional, batch.routing)
        return batch.to_grid(hc_expand(y, streams, post, comb)), batch.to_grid(ffn_pre)


def first_site_pre_mix(num_tokens: int, hc_mult: int, device: torch.device) -> torch.Tensor:
    """The initial collapse mix: one-hot on stream 0 (all streams start equal)."""
    pre = torch.zeros(num_tokens, hc_mult, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


def moe_config_for_dspark(cfg: DeepseekV41Config) -> DeepseekV41Config:
    """The DSpark stages' own expert count and top-k."""
    return dataclasses.replace(
        cfg,
        n_routed_experts=cfg.dspark_n_routed_experts or cfg.n_routed_experts,
        num_experts_per_tok=cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok,
    )
