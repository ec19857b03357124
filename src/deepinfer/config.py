"""Model configuration read from a checkpoint's ``config.json``.

We parse the released DeepSeek-V4-Flash format (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``) ourselves rather than through
``transformers.DeepseekV4Config``: the parity tests compare us against transformers, so the
two sides should not share the code that interprets the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.errors import CheckpointError

# Layer kinds of the attention schedule (model_spec.md §1.2).
SLIDING = "sliding"
CSA = "csa"  # compressed sparse attention: overlapping compressor + indexer top-k
HCA = "hca"  # heavily compressed attention: plain compressor, all visible entries

_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}


@dataclass
class YarnParams:
    """YaRN frequency scaling (no mscale: attention_factor is 1.0 for V4)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class DeepseekV4Config:
    """Every field the V4-Flash forward needs, with the released defaults."""

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
    csa_ratio: int = 4
    hca_ratio: int = 128
    layer_kinds: list[str] = field(default_factory=list)
    hash_layers: list[bool] = field(default_factory=list)
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
        kind = self.layer_kinds[layer]
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[kind]

    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_kinds) != n:
            raise CheckpointError(
                f"config.json: compress_ratios/layer_types has {len(self.layer_kinds)} entries for the "
                f"{n} backbone layers (num_hidden_layers); need at least {n}"
            )
        if len(self.hash_layers) != n:
            raise CheckpointError("config.json: num_hash_layers/mlp_layer_types does not cover every layer")
        check_shared_fields(self)


def check_shared_fields(cfg: Any) -> None:
    """Rules V4 and V4.1 share (same field names): RoPE width, output groups, routing."""
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        raise CheckpointError(
            f"config.json: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and <= head_dim ({cfg.head_dim})"
        )
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise CheckpointError("config.json: num_attention_heads*head_dim must be divisible by o_groups")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise CheckpointError("config.json: num_experts_per_tok exceeds n_routed_experts")
    if cfg.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise CheckpointError(f"config.json: unsupported scoring_func {cfg.scoring_func!r}")


def _ratio_to_kind(ratio: int, csa: int, hca: int) -> str:
    if ratio == 0:
        return SLIDING
    if ratio == csa:
        return CSA
    if ratio == hca:
        return HCA
    raise CheckpointError(
        f"config.json: compress ratio {ratio} is neither 0, the CSA rate ({csa}) nor the HCA rate ({hca})"
    )


def deepseek_v4_config_from_dict(raw: dict[str, Any]) -> DeepseekV4Config:
    """Build the config from the released V4 ``config.json`` (or the transformers spelling)."""
    known = DeepseekV4Config.__dataclass_fields__
    kwargs: dict[str, Any] = {k: raw[k] for k in known if k in raw and k not in ("yarn", "eos_token_id")}
    cfg = DeepseekV4Config(**kwargs)
    n = cfg.num_hidden_layers

    rates = dict(raw.get("compress_rates") or {})
    cfg.csa_ratio = int(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", cfg.csa_ratio)))
    cfg.hca_ratio = int(
        raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", cfg.hca_ratio))
    )

    if raw.get("layer_types") is not None:
        try:
            cfg.layer_kinds = [_HF_LAYER_TYPES[t] for t in raw["layer_types"][:n]]
        except KeyError as exc:
            raise CheckpointError(f"config.json: unknown layer type {exc.args[0]!r} in layer_types") from exc
    elif raw.get("compress_ratios") is not None:
        ratios = [int(r) for r in raw["compress_ratios"]]
        cfg.layer_kinds = [_ratio_to_kind(r, cfg.csa_ratio, cfg.hca_ratio) for r in ratios[:n]]
    else:
        raise CheckpointError("config.json: neither compress_ratios nor layer_types is present")

    if raw.get("mlp_layer_types") is not None:
        cfg.hash_layers = [t == "hash_moe" for t in raw["mlp_layer_types"][:n]]
    else:
        n_hash = int(raw.get("num_hash_layers", 0) or 0)
        cfg.hash_layers = [i < n_hash for i in range(n)]

    cfg.yarn = parse_compress_rope(raw, cfg)
    if "partial_rotary_factor" in raw and "qk_rope_head_dim" not in raw:
        cfg.qk_rope_head_dim = int(cfg.head_dim * float(raw["partial_rotary_factor"]))

    eos = raw.get("eos_token_id", 1)
    cfg.eos_token_id = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    cfg.quantization = raw.get("quantization_config")
    archs = raw.get("architectures") or ["DeepseekV4ForCausalLM"]
    cfg.architecture = archs[0]
    cfg.validate()
    return cfg


def parse_compress_rope(raw: dict[str, Any], cfg: Any) -> YarnParams | None:
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


def load_config_json(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint directory with a clear error when it is absent."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {Path(path)}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc


@dataclass
class EngineConfig:
    """Engine knobs (DESIGN.md §6: ``LLM(path, **EngineConfig fields)``)."""

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16  # rounded up to a multiple of every compression ratio
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    cache_memory_bytes: int | None = None  # KV budget; default: a fraction of free memory
    cache_memory_fraction: float = 0.25
    num_cache_blocks: int | None = None  # exact block count (overrides the budget); tests
    enable_prefix_caching: bool = True
    # None = auto: on for CUDA (the GPU computes while the CPU schedules), off on CPU, where
    # the model and the scheduler compete for the same cores (measured 2.4x slower on 2 cores)
    async_scheduling: bool | None = None
    fake_quant: bool | None = None  # None: the model's default (V4 off, V4.1 on)
    # V4.1's causal encoder/decoder prefill (model_spec.md §2.9): decoder layers run only over
    # each prompt's last window; approximate (not the reference forward), so off by default
    ced_prefill: bool = False
    # torch.compile the model step (compilation.py). None = the platform's default: on for
    # CUDA, off on CPU, where the compiled tiny-V4 decode step is 1.5-2x faster but the first
    # compile costs ~50 s on 2 cores (~20 s from the warm compile cache; benchmarks/RESULTS.md)
    compile: bool | None = None
    compile_backend: str = "inductor"  # any torch.compile backend ("eager" checks guards fast)
    # Replay pure-decode steps from captured graphs (CUDA graphs; NPU graph mode) in batch-size
    # buckets up to max_graph_batch_size. None = on where the platform has a graph mode.
    capture_graphs: bool | None = None
    max_graph_batch_size: int = 64
    # Speculative decoding: None, or a deepinfer.spec.SpeculativeConfig / dict of its fields.
    # Drafting reads the previous step's tokens, so speculative steps run synchronously; with
    # async_scheduling on (or auto on CUDA) the hardware schedule takes its production form,
    # whose verify capacity is known two steps ahead (lagged_topk_schedule)
    speculative: Any = None

    def validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def positive_int(name: str) -> None:
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, "an integer >= 1"
            )

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_graph_batch_size"):
            positive_int(name)
        for name in ("max_model_len", "cache_memory_bytes", "num_cache_blocks"):
            if getattr(self, name) is not None:
                positive_int(name)
        frac = self.cache_memory_fraction
        need(isinstance(frac, float | int) and 0 < frac <= 1, "cache_memory_fraction", "in (0, 1]")
        need(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "a bool")
        need(isinstance(self.ced_prefill, bool), "ced_prefill", "a bool")
        need(
            isinstance(self.compile_backend, str) and bool(self.compile_backend), "compile_backend", "a name"
        )
        if self.ced_prefill and self.enable_prefix_caching:
            raise ValueError(
                "ced_prefill=True needs enable_prefix_caching=False: a cached prefix holds no decoder "
                "window for positions its own prompt never replayed"
            )
        from deepinfer.spec.config import SpeculativeConfig

        self.speculative = SpeculativeConfig.parse(self.speculative)
        for name in ("async_scheduling", "fake_quant", "compile", "capture_graphs"):
            need(getattr(self, name) in (None, True, False), name, "None (auto) or a bool")
