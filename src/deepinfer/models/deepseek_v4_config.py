"""DeepSeek-V4-Flash configuration, read from the released ``config.json``
(``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) or the
transformers spelling (``layer_types``, ``mlp_layer_types``, ``rope_parameters``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import CheckpointError
from deepinfer.models.deepseek_config import DeepseekConfig, parse_compress_rope, token_id_list

# Layer kinds of the attention schedule.
SLIDING = "sliding"
CSA = "csa"  # compressed sparse attention: overlapping compressor + indexer top-k
HCA = "hca"  # heavily compressed attention: plain compressor, all visible entries

_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}


@dataclass
class DeepseekV4Config(DeepseekConfig):
    """V4-Flash: the shared fields plus its attention schedule (one kind per layer) and the
    hash-routed MoE layers."""

    csa_ratio: int = 4
    hca_ratio: int = 128
    layer_kinds: list[str] = field(default_factory=list)
    hash_layers: list[bool] = field(default_factory=list)

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
        self.check_shared_fields()


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

    cfg.eos_token_id = token_id_list(raw.get("eos_token_id", 1))
    cfg.quantization = raw.get("quantization_config")
    archs = raw.get("architectures") or ["DeepseekV4ForCausalLM"]
    cfg.architecture = archs[0]
    cfg.validate()
    return cfg
