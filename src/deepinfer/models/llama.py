"""The Llama family (dense decoder: GQA, RoPE, SwiGLU, RMSNorm, optional tied embeddings),
on the same engine as V4: paged K/V pages from ``cache_spec()`` and the same ForwardBatch.

Parameter names follow the Hugging Face layout (``model.layers.{i}.self_attn.q_proj``), so
checkpoints written by ``transformers`` and our GGUF converter load by name. The file is the
architecture alone: the forms the engine runs the projections in (fused, quantized, packed)
are set from outside (``models/layers/projection.py``), each op's implementation is picked
per step by ``models/layers/dispatch.py``, and the one-call CPU decode of every layer is the
engine's CPU backend (``engine/cpu_decode.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.errors import CheckpointError
from deepinfer.models.base import CausalLM
from deepinfer.models.dspark_head import DSparkHead, LlamaDSparkDraft, check_target
from deepinfer.models.layers import dispatch
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.projection import Projection, TiedHead


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=lambda: [2])

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim={self.head_dim} must be even for RoPE")


def llama_config_from_dict(raw: dict[str, Any]) -> LlamaConfig:
    known = LlamaConfig.__dataclass_fields__
    cfg = LlamaConfig(**{k: raw[k] for k in known if k in raw and k != "eos_token_id"})
    if not cfg.head_dim:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5 spelling
        cfg.rope_theta = float(params.get("rope_theta", cfg.rope_theta))
        if params.get("rope_type", "default") != "default":
            cfg.rope_scaling = params
    eos = raw.get("eos_token_id", 2)
    cfg.eos_token_id = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    cfg.validate()
    return cfg


def llama_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """RoPE inverse frequencies with the Llama scaling variants (default, linear, llama3)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise CheckpointError(f"config.json: unsupported rope scaling type {kind!r} for Llama")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.attention_bias)
        self.qkv = Projection(self.q_proj, self.k_proj, self.v_proj, owner=self)
        self.out = Projection(self.o_proj, owner=self)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv(x, batch)
        q, keys, values = dispatch.rope_and_store(
            qkv, cos, sin, pools, batch, self.n_heads, self.n_kv, self.head_dim
        )
        out = dispatch.attend(q, keys, values, batch)
        return self.out(out.reshape(x.shape[0], -1), batch)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.gate_up = Projection(self.gate_proj, self.up_proj, owner=self)
        self.down = Projection(self.down_proj, owner=self)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.down(dispatch.silu_and_mul(self.gate_up(x, batch), batch), batch)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        # tensor parallel: sums the row-parallel outputs (o_proj, down_proj) over the ranks
        # (set by distributed/tensor_parallel.py; None on one device)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> torch.Tensor:
        """h [T, d] -> [T, d] (on the research grid: [B, S, d])."""
        x, normed = dispatch.add_rms_norm(self.input_layernorm, batch.to_flat(h), None, batch)
        attn = self._sum(self.self_attn(normed, cos, sin, pools, batch))
        x, normed = dispatch.add_rms_norm(self.post_attention_layernorm, x, attn, batch)
        return batch.to_grid(x + self._sum(self.mlp(normed, batch)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """A Llama-family decoder with transformers' module names (``model.embed_tokens``,
    ``model.layers[i].self_attn.q_proj``, ``lm_head``), so checkpoints load by name and
    research code finds what it expects."""

    invariant_rows = True  # norms, RoPE and SwiGLU are row-wise; attention is per row

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head = Projection(TiedHead(self.model.embed_tokens) if cfg.tie_word_embeddings else self.lm_head)
        self._inv_freq = llama_inv_freq(cfg)  # host copy; the step reads a per-device one
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        # tensor parallel with the vocabulary split (distributed/tensor_parallel.py): (this
        # rank's first token id, sum over the ranks, gather of the logits' columns)
        self.vocab_parallel: tuple[int, Callable, Callable] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (``model.layers``), at the top level as V4's are."""
        return self.model.layers

    def cache_spec(self) -> list[LayerCacheSpec]:
        kv_dim = self.config.num_key_value_heads * self.config.head_dim
        return [LayerCacheSpec(window=0, kv_dim=kv_dim, separate_values=True)] * self.config.num_hidden_layers

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies on ``device``, copied once: a step captured as a CUDA graph must
        not copy from the host (the capture's warm-up run fills this cache)."""
        inv = self._inv_freq_by_device.get(device)
        if inv is None:
            inv = self._inv_freq_by_device.setdefault(device, self._inv_freq.to(device))
        return inv

    def step_tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per-device tables the step reads, made before ``torch.compile`` traces it."""
        return [self.inv_freq(device)]

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2] of each token's position."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq(positions.device)
        return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)

    def draft_head(self, head: DSparkHead) -> LlamaDSparkDraft:
        """A DSpark head trained for this target, with the embedding and head it shares."""
        cfg = self.config
        check_target(head.config, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers)
        if self.vocab_parallel is not None:
            raise ValueError("speculative_config.model: a DSpark head runs on one rank")
        return LlamaDSparkDraft(head, self.model.embed_tokens, self.head_rows, self.head.weight_and_bias()[0])

    def head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection of normed rows ``h`` [N, d] in the engine's form of the weight."""
        engine = self.head.engine
        return engine(h) if engine is not None else self.head.plain(h)

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One engine step (see ``CausalLM``): flat tokens in, logits for ``batch.logits_idx``;
        with ``batch.feature_idx`` also those rows' hidden states entering each of
        ``batch.feature_layers``, concatenated (a DSpark head's features)."""
        return self.step_embedded(self.embed(input_ids), positions, batch)

    def step_embedded(
        self, h: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``step`` from the tokens' embeddings ``h`` [T, d]."""
        batch = batch.expanded()  # a captured step's compact decode rows, made on the device
        cos, sin = self.rope_tables(positions)
        h = batch.to_grid(h)
        batch.record(h)
        wanted = batch.feature_layers if batch.feature_idx is not None else ()
        features = []
        for i, (layer, layer_pools) in enumerate(zip(self.model.layers, batch.pools, strict=True)):
            if i in wanted:
                features.append(batch.to_flat(h)[batch.feature_idx])
            h = layer(h, cos, sin, layer_pools, batch)
            batch.record(h)
        logits = self.logits(batch.to_flat(h), batch)
        if batch.feature_idx is not None:
            return logits, torch.cat(features, dim=-1) if features else logits.new_zeros(0)
        return logits

    def logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits of the rows ``batch.logits_idx`` picks (every row when None) of the
        last layer's output ``h`` [T, d]."""
        if batch.logits_idx is not None:
            h = h[batch.logits_idx]
        _, h = dispatch.add_rms_norm(self.model.norm, h, None, batch)
        logits = self.head(h, batch).float()
        return logits if self.vocab_parallel is None else self.vocab_parallel[2](logits)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; with a vocab-parallel embedding, this rank's rows (others zero)
        summed over the ranks."""
        weight = self.model.embed_tokens.weight
        if self.vocab_parallel is None:
            return self.model.embed_tokens(input_ids)
        offset, reduce, _ = self.vocab_parallel
        rows = weight.shape[0]
        local = (input_ids >= offset) & (input_ids < offset + rows)
        h = F.embedding((input_ids - offset).clamp(0, rows - 1), weight) * local.unsqueeze(-1).to(
            weight.dtype
        )
        return reduce(h)
