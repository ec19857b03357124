"""DeepSeek-V4.1-Flash configuration.

Two spellings of the same model load here: the released composite ``config.json`` (a
``text_config`` next to a ``vision_config``) and the flat reference ``inference/config.json``
(``dim``, ``n_layers``, ``kv_source_layers``, ...). The layer roles (which layers own a
compressor, which score top-k, which reuse them) are derived once in :func:`layer_plan` and
checked against the layer-role rules, so a malformed config fails at load with the field named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import CheckpointError
from deepinfer.models.deepseek_config import DeepseekConfig, parse_compress_rope, token_id_list
from deepinfer.models.layers.rope import YarnParams

# Flat reference names (inference/config.json) -> our (transformers-style) names.
_FLAT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "n_mtp_layers": "num_nextn_predict_layers",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "max_seq_len": "max_position_embeddings",
}


@dataclass
class DeepseekV41Config(DeepseekConfig):
    """V4.1-Flash: the shared fields (with V4.1's released values where they differ from V4) plus
    KV/top-k sharing, the candidate top-k, Engram and the DSpark draft stages."""

    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_key_value_heads: int = 1
    q_lora_rank: int = 1280
    n_routed_experts: int = 384
    moe_intermediate_size: int = 2304
    rms_norm_eps: float = 1e-20
    yarn: YarnParams | None = field(default_factory=lambda: YarnParams(16.0, 65536, 32.0, 1.0))
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int | None = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    architecture: str = "DeepseekV41ForCausalLM"
    # Runtime choice, not read from config.json: the QAT rounding is part of V4.1's reference
    # forward (and of transformers' V4.1 port), so it is on unless a caller turns it off.
    fake_quant: bool = True

    @property
    def hash_layers(self) -> list[bool]:
        """V4.1 has no hash-routed layers (the shared MoE reads this)."""
        return [False] * self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def plan(self) -> list[LayerRole]:
        return layer_plan(self)

    def validate(self) -> None:
        layer_plan(self)  # raises on any broken role rule
        self.check_shared_fields()
        if self.qk_rope_head_dim > self.index_head_dim:
            _fail("qk_rope_head_dim", f"must be <= index_head_dim ({self.index_head_dim})")
        if self.num_key_value_heads != 1:
            _fail("num_key_value_heads", f"must be 1 (one shared K=V latent), got {self.num_key_value_heads}")
        if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
            _fail("candidate_block_size", "and candidate_topk_blocks must be >= 1")
        self._validate_engram()
        self._validate_dspark()

    def _validate_dspark(self) -> None:
        if not self.num_nextn_predict_layers or not self.dspark_block_size:
            return
        n = self.num_hidden_layers
        if not self.dspark_target_layer_ids:
            _fail("dspark_target_layer_ids", "must name at least one backbone layer when DSpark stages exist")
        for i in self.dspark_target_layer_ids:
            if not 0 <= i < n:
                _fail("dspark_target_layer_ids", f"layer {i} is outside 0..{n - 1}")
        extra = self.compress_ratios[n : n + self.num_nextn_predict_layers]
        if any(extra):
            _fail("compress_ratios", f"DSpark stages must be sliding-window only (ratio 0), got {extra}")

    def _validate_engram(self) -> None:
        n = self.num_hidden_layers
        for i in self.engram_layer_ids:
            if not 0 <= i < n:
                _fail("engram_layer_ids", f"layer {i} is outside 0..{n - 1}")
        if not self.engram_layer_ids:
            return
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            _fail("engram_num_embeddings", "needs one table size per entry of engram_layer_ids")
        if self.engram_max_ngram_size < 2:
            _fail("engram_max_ngram_size", "must be >= 2")
        if self.engram_max_ngram_size > max(self.sliding_window, 1):
            _fail("engram_max_ngram_size", f"must be <= sliding_window ({self.sliding_window})")
        if not 0 <= self.engram_pad_token_id < self.vocab_size:
            _fail("engram_pad_token_id", f"must be a token id below vocab_size ({self.vocab_size})")


def _fail(name: str, rule: str) -> None:
    raise CheckpointError(f"config.json: {name} {rule}")


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer computes and reads."""

    layer: int
    ratio: int  # 0: sliding window only
    kv_source: int | None  # layer whose compressed entries this layer reads
    index_source: int | None  # layer whose top-k this layer uses (itself if it scores)
    uses_candidates: bool  # scores only inside the candidate source's blocks
    is_candidate_source: bool
    engram: bool

    @property
    def owns_kv(self) -> bool:
        """A KV source: owns the compressor, the compressed cache and the index keys."""
        return self.ratio > 0 and self.kv_source == self.layer

    @property
    def scores_topk(self) -> bool:
        """An index source: runs its own indexer queries and top-k."""
        return self.ratio > 0 and self.index_source == self.layer


def layer_plan(cfg: DeepseekV41Config) -> list[LayerRole]:
    """Derive every backbone layer's role and enforce the layer-role rules with clear errors."""
    n = cfg.num_hidden_layers
    ratios = cfg.compress_ratios
    if len(ratios) < n:
        _fail("compress_ratios", f"has {len(ratios)} entries for {n} layers (num_hidden_layers)")
    if any(r < 0 for r in ratios):
        _fail("compress_ratios", "entries must be >= 0")
    kv_sources, index_sources = sorted(cfg.kv_source_layer_ids), sorted(cfg.index_source_layer_ids)
    for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        for i in ids:
            if not 0 <= i < n:
                _fail(name, f"layer {i} is outside 0..{n - 1}")
    for i in kv_sources:
        if ratios[i] == 0:
            _fail("kv_source_layer_ids", f"layer {i} has compress ratio 0; a KV source must compress")
        if i not in index_sources:
            _fail("index_source_layer_ids", f"must contain every KV source; layer {i} is missing")
    cand = cfg.candidate_source_layer_id
    if cand is not None and cand not in kv_sources:
        _fail("candidate_source_layer_id", f"{cand} is not a KV source ({kv_sources})")

    roles = []
    for i in range(n):
        r = ratios[i]
        if r == 0:
            if i in index_sources:
                _fail("index_source_layer_ids", f"layer {i} has compress ratio 0 and cannot score top-k")
            roles.append(LayerRole(i, 0, None, None, False, False, i in cfg.engram_layer_ids))
            continue
        kv = max((s for s in kv_sources if s <= i), default=None)
        if kv is None:
            _fail(
                "kv_source_layer_ids", f"layer {i} compresses (ratio {r}) but no KV source is at or before it"
            )
        if ratios[kv] != r:
            _fail(
                "compress_ratios",
                f"layer {i} has ratio {r} but its KV source (layer {kv}) has ratio {ratios[kv]}",
            )
        idx = max(s for s in index_sources if s <= i)  # kv itself qualifies
        uses = cand is not None and idx == i and i > cand  # only scoring layers mask
        if uses and ratios[cand] != r:
            _fail("compress_ratios", f"layer {i} uses candidates of layer {cand}, which has another ratio")
        roles.append(LayerRole(i, r, kv, idx, uses, i == cand, i in cfg.engram_layer_ids))
    return roles


def is_v41_config(raw: dict[str, Any]) -> bool:
    """Whether a config dict (composite, text-only or flat) describes V4.1."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    archs = raw.get("architectures") or []
    return (
        "DeepseekV41ForCausalLM" in archs
        or raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text")
        or "kv_source_layers" in text
        or "kv_source_layer_ids" in text
    )


def deepseek_v41_config_from_dict(raw: dict[str, Any]) -> DeepseekV41Config:
    """Build the config from the composite ``config.json``, its ``text_config``, or the flat
    reference ``inference/config.json``."""
    text = dict(raw["text_config"]) if isinstance(raw.get("text_config"), dict) else dict(raw)
    for flat, ours in _FLAT_NAMES.items():
        if flat in text and ours not in text:
            text[ours] = text[flat]
    known = DeepseekV41Config.__dataclass_fields__
    skip = {"yarn", "eos_token_id", "quantization", "architecture", "fake_quant"}
    kwargs = {k: text[k] for k in known if k in text and k not in skip}
    cfg = DeepseekV41Config(**kwargs)
    _check_types(cfg)
    if cfg.candidate_source_layer_id is not None and cfg.candidate_source_layer_id < 0:
        cfg.candidate_source_layer_id = None  # the reference's "-1: no candidate level"
    cfg.compress_ratios = [int(r) for r in cfg.compress_ratios]
    cfg.yarn = _yarn(text, cfg)
    cfg.eos_token_id = token_id_list(text.get("eos_token_id", raw.get("eos_token_id", 1)))
    cfg.bos_token_id = text.get("bos_token_id", raw.get("bos_token_id", cfg.bos_token_id))
    cfg.quantization = raw.get("quantization_config") or text.get("quantization_config")
    if cfg.quantization is None and text.get("dtype") == "fp8":  # flat reference config
        block = text.get("weight_block_size", [32, 32])
        cfg.quantization = {
            "quant_method": "fp8",
            "weight_block_size": block,
            "scale_fmt": text.get("scale_fmt"),
        }
    cfg.architecture = "DeepseekV41ForCausalLM"
    cfg.validate()
    return cfg


def _check_types(cfg: DeepseekV41Config) -> None:
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "compress_ratios", "engram_layer_ids"):
        value = getattr(cfg, name)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            _fail(name, f"must be a list of integers, got {value!r}")


def _yarn(text: dict[str, Any], cfg: DeepseekV41Config) -> YarnParams | None:
    """YaRN of the compressed layers; the flat reference config spells it ``rope_factor``,
    ``original_seq_len``, ``beta_fast``, ``beta_slow``."""
    if "rope_factor" in text and not (text.get("rope_scaling") or text.get("rope_parameters")):
        text = {
            "rope_scaling": {
                "type": "yarn",
                "factor": text["rope_factor"],
                "original_max_position_embeddings": text.get("original_seq_len", 65536),
                "beta_fast": text.get("beta_fast", 32),
                "beta_slow": text.get("beta_slow", 1),
            }
        }
    return parse_compress_rope(text, cfg)
