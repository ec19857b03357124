"""What DeepSeek V4 and V4.1 configs share: the fields of their common layers (latent
attention, mHC, the routed MoE, the indexer, YaRN) with V4-Flash's released values, the rules
those fields obey, and the parsing both ``config.json`` spellings need.

We parse the released formats ourselves rather than through ``transformers``' config classes:
the parity tests compare us against transformers, so the two sides should not share the code
that interprets the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import CheckpointError
from deepinfer.models.layers.rope import YarnParams


@dataclass
class DeepseekConfig:
    """The fields every DeepSeek-V4-class forward reads (V4-Flash's values as defaults; each
    model's config overrides those its release changed and adds its own)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnParams | None = None
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # the MTP (next-n) layers after the backbone
    quantization: dict[str, Any] | None = None
    architecture: str = "DeepseekV4ForCausalLM"
    # Runtime choice, not read from config.json: apply the QAT fake-quant steps.
    fake_quant: bool = False

    def ratio(self, layer: int) -> int:
        """Compression ratio of backbone layer ``layer`` (0: sliding window only)."""
        raise NotImplementedError

    def check_shared_fields(self) -> None:
        """Rules V4 and V4.1 share (same field names): RoPE width, output groups, routing."""
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise CheckpointError(
                f"config.json: qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim ({self.head_dim})"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise CheckpointError("config.json: num_attention_heads*head_dim must be divisible by o_groups")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise CheckpointError("config.json: num_experts_per_tok exceeds n_routed_experts")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise CheckpointError(f"config.json: unsupported scoring_func {self.scoring_func!r}")


def token_id_list(value: Any) -> list[int]:
    """``eos_token_id`` as a list: config.json holds one id, a list, or null."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def parse_compress_rope(raw: dict[str, Any], cfg: DeepseekConfig) -> YarnParams | None:
    """YaRN of the compressed layers, from ``rope_scaling`` (released spelling) or
    ``rope_parameters`` (transformers: ``{main, compress}``, which also carry the two thetas,
    written into ``cfg``). Shared by V4 and V4.1."""
    rope = raw.get("rope_scaling") or {}
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("compress"), dict):
        rope = params["compress"]
        cfg.compress_rope_theta = float(rope.get("rope_theta", cfg.compress_rope_theta))
        if isinstance(params.get("main"), dict):
            cfg.rope_theta = float(params["main"].get("rope_theta", cfg.rope_theta))
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "yarn":
        return YarnParams(
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
        )
    if rope_type not in (None, "default"):
        raise CheckpointError(f"config.json: unsupported rope scaling type {rope_type!r}")
    return None
