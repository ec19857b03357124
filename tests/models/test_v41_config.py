"""V4.1 config: the released composite config.json and the flat reference names both load,
layer roles follow the published role rules (``layer_plan``), broken ones fail with the field
named, and the released shape instantiated on the meta device has the published parameter
counts."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.errors import CheckpointError
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41_config import deepseek_v41_config_from_dict
from deepinfer.models.param_count import count_parameters
from deepinfer.models.registry import resolve
from deepinfer.models.released_configs import V41_FLASH, V41_FLASH_FLAT, V41_FLASH_TEXT

RELEASED_TEXT, RELEASED = V41_FLASH_TEXT, V41_FLASH

FLAT = V41_FLASH_FLAT


def test_released_config_parses_with_the_published_roles():
    cfg, cls = resolve(RELEASED)
    assert cls is DeepseekV41ForCausalLM
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.rms_norm_eps) == (
        5120,
        40,
        384,
        1e-20,
    )
    assert (
        cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    )
    assert cfg.quantization["weight_block_size"] == [32, 32]
    plan = cfg.plan()
    assert [r.ratio for r in plan[:3]] == [0, 0, 2] and plan[20].ratio == 1
    owners = [i for i, r in enumerate(plan) if r.ratio and r.kv_source == i]
    assert owners == [2, 8, 14, 20]
    assert plan[3].kv_source == 2 and plan[3].index_source == 2
    assert plan[19].kv_source == 14 and plan[21].index_source == 20
    assert plan[25].kv_source == 20 and plan[25].index_source == 24
    assert plan[20].is_candidate_source and not plan[20].uses_candidates
    assert [i for i, r in enumerate(plan) if r.uses_candidates and r.index_source == i] == [24, 28, 32, 36]
    assert [i for i, r in enumerate(plan) if r.engram] == [1, 14]


def test_flat_reference_names_give_the_same_config():
    composite = deepseek_v41_config_from_dict(RELEASED)
    cfg, cls = resolve(FLAT)  # no "architectures": recognised by its fields
    assert cls is DeepseekV41ForCausalLM
    for field in composite.__dataclass_fields__:
        if field not in ("quantization", "eos_token_id", "bos_token_id"):
            assert getattr(cfg, field) == getattr(composite, field), field
    assert cfg.quantization["quant_method"] == "fp8"


def _broken(**changes):
    raw = copy.deepcopy(RELEASED)
    raw["text_config"].update(changes)
    return raw


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kv_source_layer_ids": [1, 8, 14, 20]}, "kv_source_layer_ids"),  # ratio-0 source
        # ratio-1 layers would read a ratio-2 source
        ({"kv_source_layer_ids": [2, 8, 14], "candidate_source_layer_id": None}, "compress_ratios"),
        ({"index_source_layer_ids": [2, 8, 20, 24]}, "index_source_layer_ids"),  # source 14 not indexing
        ({"candidate_source_layer_id": 24}, "candidate_source_layer_id"),  # not a KV source
        # layer 2 compresses but has no source at or before it
        (
            {"kv_source_layer_ids": [3, 8, 14, 20], "index_source_layer_ids": [3, 8, 14, 20, 24]},
            "kv_source_layer_ids",
        ),
        ({"index_source_layer_ids": [0, 2, 8, 14, 20]}, "index_source_layer_ids"),  # ratio-0 indexer
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),  # too short
        ({"engram_layer_ids": [1, 40]}, "engram_layer_ids"),
        ({"engram_num_embeddings": [384006168]}, "engram_num_embeddings"),
        ({"dspark_target_layer_ids": [37, 38, 40]}, "dspark_target_layer_ids"),
        ({"kv_source_layer_ids": "2,8"}, "kv_source_layer_ids"),
    ],
)
def test_broken_role_rules_name_the_field(changes, field):
    with pytest.raises(CheckpointError, match=field):
        resolve(_broken(**changes))


def test_engram_table_sizes_must_match_the_hash_primes():
    cfg = deepseek_v41_config_from_dict(_broken(engram_num_embeddings=[384006168, 384016681]))
    with torch.device("meta"), pytest.raises(CheckpointError, match="engram_num_embeddings"):
        DeepseekV41ForCausalLM(cfg)


def test_released_shape_on_meta_has_the_published_parameter_counts():
    cfg, cls = resolve(RELEASED)
    with torch.device("meta"):
        model = cls(cfg)
    counts = count_parameters(model)
    print(
        f"total {counts.total / 1e9:.2f}B, backbone {counts.backbone / 1e9:.2f}B, "
        f"Engram tables {counts.engram_tables / 1e9:.2f}B, DSpark {counts.draft_stages / 1e9:.2f}B, "
        f"active/token {counts.active_per_token / 1e9:.2f}B"
    )
    assert 550e9 < counts.backbone < 554e9  # "552B"
    assert 543e9 < counts.routed_experts < 544.5e9  # 40 * 384 * 3 * 5120 * 2304
    assert 196e9 < counts.engram_tables < 197e9  # 768M rows x 256
    assert 760e9 < counts.total < 765e9  # "763B parameters" of the released checkpoint
    assert 15e9 < counts.active_per_token < 17e9  # "16B decode"
