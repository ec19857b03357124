"""DeepSeek-V4-Flash in plain PyTorch (V4 variant of each block).

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
from deepinfer.models.layers.mhc import (
    MIXING_FUNCTIONS,
    HyperConnectedBlock,
    hc_expand,
    hc_head_collapse,
)
from deepinfer.models.layers.moe import ROUTER_WEIGHT, MoE
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary
from deepinfer.weights.writer import FP8_LINEARS


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
        """streams [T, n, d] -> [T, n, d] (on the research grid: [B, S, n, d])."""
        streams = batch.to_flat(streams)
        x, _, post, comb = self.pre(streams, "attn")
        y = self.attn(self.attn_norm(x), positions, pools, batch)
        streams = hc_expand(y, streams, post, comb)
        x, _, post, comb = self.pre(streams, "ffn")
        y = self.ffn(self.ffn_norm(x), input_ids, batch.functional, batch.routing)
        return batch.to_grid(hc_expand(y, streams, post, comb))


class MtpBlock(Block):
    """V4's next-n (MTP) layer ``mtp.{k}`` (the official V4 ``MTPBlock``):
    a sliding-window block whose input mixes the embedding of the next token with the
    backbone's final streams, with its own ``hc_head`` collapse and norm before the shared
    head. Only the drafter runs it (through ``MtpDraftModel``)."""

    def __init__(self, cfg: DeepseekV4Config, main_rope: Rotary, compress_rope: Rotary) -> None:
        layer = cfg.num_hidden_layers
        own = dataclasses.replace(
            cfg, layer_kinds=[*cfg.layer_kinds, SLIDING], hash_layers=[*cfg.hash_layers, False]
        )
        super().__init__(own, layer, main_rope, compress_rope)
        n, h = cfg.hc_mult, cfg.hidden_size
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
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

    def window_kv(
        self, token_embeds: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The K=V vector [N, D] of row t (streams of t, the embedding of token t + 1) at
        position t: a row-wise projection of the block input, kept for later rows' windows."""
        x = self.merge_input(token_embeds, streams)
        attn_in = self.attn_norm(self.pre(x, "attn")[0])
        cos, sin = self.attn.rotary(positions)
        return self.attn.latent_kv(attn_in, cos, sin)

    def forward(  # type: ignore[override]  (a draft row, not a backbone step)
        self,
        streams: torch.Tensor,
        token_embeds: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor],
        earlier: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft row per sequence: the block over (``streams``, next ``tokens``) at
        ``positions``, attending to ``window`` (ring rows [N, W, D], visibility [N, W]) and,
        unless ``earlier`` is None (the row is accepted: its K=V is in the ring), to the K=V
        of this proposal's ``earlier`` rows and its own. Returns (output streams, the normed
        head input [N, d], this row's K=V)."""
        x = self.merge_input(token_embeds, streams)
        attn_in, _, post, comb = self.pre(x, "attn")
        attn_in = self.attn_norm(attn_in)
        q, _, cos, sin = self.attn.queries(attn_in, positions)
        kv = self.attn.latent_kv(attn_in, cos, sin)
        ring, visible = window
        parts = [(ring.to(kv.dtype), visible)]
        if earlier is not None:
            rows = torch.stack([*earlier, kv], dim=1)
            parts.append((rows, torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)))
        y = self.attn.attend(q, parts, cos, sin)
        x = hc_expand(y, x, post, comb)
        ffn_in, _, post, comb = self.pre(x, "ffn")
        y = self.ffn(self.ffn_norm(ffn_in), tokens)
        streams = hc_expand(y, x, post, comb)
        head_in = hc_head_collapse(
            streams,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
        )
        return streams, self.norm(head_in), kv


class MtpDraftModel:
    """The MTP layer with the backbone's embedding and head: every computation the MTP
    drafter runs, none of its bookkeeping (ring, sampling)."""

    def __init__(self, block: MtpBlock, embed: nn.Embedding, head: nn.Linear, cfg: DeepseekV4Config) -> None:
        self.block, self.embed, self.head = block, embed, head
        self.window = cfg.sliding_window
        self.kv_dim = cfg.head_dim
        self.hc_mult, self.hidden_size = cfg.hc_mult, cfg.hidden_size
        self.dtype = embed.weight.dtype
        self.device = embed.weight.device

    def window_kv(
        self, streams: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return self.block.window_kv(self.embed(next_tokens), streams, positions)

    def draft_row(
        self,
        streams: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor],
        earlier: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fp32 logits [N, V], output streams, this row's K=V); see ``MtpBlock.forward``."""
        streams, head_in, kv = self.block(streams, self.embed(tokens), tokens, positions, window, earlier)
        return self.head(head_in).float(), streams, kv


class DeepseekV4ForCausalLM(CausalLM):
    """The V4-Flash backbone + head (and the MTP layer ``mtp.0``, run only by its drafter)."""

    cpu_compile_pays = True  # compiled beats eager at bs 1 on the tiny V4 (benchmarks/RESULTS.md)

    # Parameters DeepSeek's reference code keeps in fp32 whatever the compute dtype.
    fp32_param_markers = ("norm.weight", "hc_", "attn_sink", ".ape", "gate.bias")
    # the linears the release format stores as fp8 blocks (``quantization="fp8"``)
    fp8_linear_markers = FP8_LINEARS
    # The MTP layer: unused when the config asks for none, optional when it does.
    ignored_checkpoint_prefixes = ("mtp.",)
    optional_checkpoint_prefix = "mtp."

    # compiled CPU steps run its projections on packed copies: these beside nn.Linear weights
    projection_params = (*MIXING_FUNCTIONS, ROUTER_WEIGHT)

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

    def draft_model(self, method: str) -> MtpDraftModel | None:
        """The MTP layer (``method="mtp"``), when the checkpoint has it."""
        if method != "mtp" or not len(self.mtp):
            return None
        return MtpDraftModel(self.mtp[0], self.embed, self.head, self.config)

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
                    # the QAT formats every written value has (fake-quant on)
                    window_format="fp8_pow2_32" if cfg.fake_quant else None,
                    entry_format="fp4_e4m3_16" if cfg.fake_quant and ratio else None,
                    index_format="fp4_pow2_32" if cfg.fake_quant and overlap else None,
                )
            )
        return specs

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One engine step (see ``CausalLM``): flat tokens in, logits for ``batch.logits_idx``;
        with ``batch.feature_idx`` also those rows' final streams [N, n * d] (the MTP input)."""
        h = self.embed(input_ids)
        streams = h.unsqueeze(1).expand(h.shape[0], self.config.hc_mult, h.shape[-1]).contiguous()
        streams = batch.to_grid(streams)
        batch.record(streams)
        for layer, pools in zip(self.layers, batch.pools, strict=True):
            streams = layer(streams, positions, input_ids, pools, batch)
            batch.record(streams)
        streams = batch.to_flat(streams)
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
