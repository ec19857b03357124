"""DeepSeek-V4-Flash in plain PyTorch (model_spec.md §1.2-§2; V4 variant of each block).

Module and parameter names follow the official checkpoint layout (``embed``,
``layers.{i}.attn.wq_a``, ``layers.{i}.hc_attn_fn``, ``head``, ...) so weights load by name.
The model is a pure function of ``(input_ids, positions, ForwardBatch)``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.layers.attention import Attention
from deepinfer.models.layers.mhc import HyperConnectedBlock, hc_collapse, hc_expand, hc_head_collapse
from deepinfer.models.layers.moe import MoE
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary


class Block(HyperConnectedBlock):
    """Attention and MoE, each wrapped in an mHC site (V4: ``pre`` used at its own site)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, main_rope: Rotary, compress_rope: Rotary) -> None:
        super().__init__(cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        self.attn = Attention(cfg, layer, main_rope, compress_rope)
        self.ffn = MoE(cfg, layer)

    def forward(
        self,
        streams: torch.Tensor,
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        pools: LayerPools,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """streams [T, n, d] -> [T, n, d]."""
        pre, post, comb = self.mixes(streams, "attn")
        y = self.attn(self.attn_norm(hc_collapse(streams, pre)), positions, pools, batch)
        streams = hc_expand(y, streams, post, comb)
        pre, post, comb = self.mixes(streams, "ffn")
        y = self.ffn(self.ffn_norm(hc_collapse(streams, pre)), input_ids)
        return hc_expand(y, streams, post, comb)


class MtpBlock(Block):
    """V4's next-n (MTP) layer ``mtp.{k}`` (techniques.md §1.5; the official V4 ``MTPBlock``):
    a sliding-window block whose input mixes the embedding of the next token with the
    backbone's final streams, with its own ``hc_head`` collapse and norm before the shared
    head. Only the drafter runs it (``deepinfer.speculative.mtp``)."""

    def __init__(self, cfg: DeepseekV4Config, main_rope: Rotary, compress_rope: Rotary) -> None:
        layer = cfg.num_hidden_layers
        own = dataclasses.replace(
            cfg, layer_kinds=[*cfg.layer_kinds, SLIDING], hash_layers=[*cfg.hash_layers, False]
        )
        super().__init__(own, layer, main_rope, compress_rope)
        n, h = cfg.hc_mult, cfg.hidden_size
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def merge_input(self, token_embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """Block input [N, n, d] from the next tokens' embeddings [N, d] and the backbone's
        (or the previous draft row's) final streams [N, n, d]."""
        return self.e_proj(self.enorm(token_embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))


class DeepseekV4ForCausalLM(CausalLM):
    """The V4-Flash backbone + head. ``model(input_ids)`` returns full logits (no cache)."""

    # Parameters the reference keeps in fp32 whatever the compute dtype (model_spec.md §2.10).
    fp32_param_markers = ("norm.weight", "hc_", "attn_sink", ".ape", "gate.bias")
    # The MTP layer: unused when the config asks for none, optional when it does.
    ignored_checkpoint_prefixes = ("mtp.",)
    optional_checkpoint_prefix = "mtp."

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.config = cfg
        rd = cfg.qk_rope_head_dim
        main_rope = Rotary(rd, cfg.rope_theta, None)
        compress_rope = Rotary(rd, cfg.compress_rope_theta, cfg.yarn)
        n, h = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(
            Block(cfg, i, main_rope, compress_rope) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.mtp = nn.ModuleList(
            MtpBlock(cfg, main_rope, compress_rope) for _ in range(min(cfg.num_nextn_predict_layers, 1))
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def drop_optional_layers(self) -> None:
        self.mtp = nn.ModuleList()

    def cache_spec(self) -> list[LayerCacheSpec]:
        cfg = self.config
        specs = []
        for i, kind in enumerate(cfg.layer_kinds):
            ratio, overlap = cfg.ratio(i), kind == CSA
            specs.append(
                LayerCacheSpec(
                    window=cfg.sliding_window,
                    kv_dim=cfg.head_dim,
                    ratio=ratio,
                    overlap=overlap,
                    compressor_width=cfg.head_dim * (2 if overlap else 1) if ratio else 0,
                    index_dim=cfg.index_head_dim if overlap else 0,
                    index_width=2 * cfg.index_head_dim if overlap else 0,
                )
            )
        return specs

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One engine step (see ``CausalLM``): flat tokens in, logits for ``batch.logits_idx``;
        with ``batch.feature_idx`` also those rows' final streams [N, n * d] (the MTP input)."""
        h = self.embed(input_ids)
        streams = h.unsqueeze(1).expand(h.shape[0], self.config.hc_mult, h.shape[-1]).contiguous()
        for layer, pools in zip(self.layers, batch.pools, strict=True):
            streams = layer(streams, positions, input_ids, pools, batch)
        features = streams[batch.feature_idx].flatten(1) if batch.feature_idx is not None else None
        if batch.logits_idx is not None:
            streams = streams[batch.logits_idx]
        x = hc_head_collapse(
            streams,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            hc_eps=self.config.hc_eps,
            norm_eps=self.config.rms_norm_eps,
        )
        logits = self.head(self.norm(x)).float()
        return logits if features is None else (logits, features)
