"""The V4.1 release format on a tiny checkpoint: fp8 e4m3 linears with 32x32 ue8m0 block
scales, fp4 e2m1 routed experts with per-32 scales, fp8 Engram rows with per-32 scales (kept
fp8 in memory, dequantised per lookup), DSpark stages loaded, vision keys skipped."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.errors import CheckpointError
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.quant import dequantize_fp4
from deepinfer.weights.writer import write_safetensors


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v41fp8"), arch="deepseek_v41", seed=3, quant="fp8")


def _dequantized_twin(src, dst) -> None:
    """Dequantize every stored tensor independently of the loader and write fp32 files."""
    raw = load_file(str(src / "model.safetensors"))
    twin: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name[: -len("weight")] + "scale")
        if t.dtype == torch.float8_e4m3fn:
            rows = 1 if scale.shape[0] == t.shape[0] else 32  # Engram rows vs 32x32 blocks
            full = scale.float().repeat_interleave(rows, 0).repeat_interleave(32, 1)
            twin[name] = t.float() * full[: t.shape[0], : t.shape[1]]
        elif t.dtype == torch.int8:
            twin[name] = dequantize_fp4(t, scale)
        else:
            twin[name] = t.float() if t.is_floating_point() else t
    write_safetensors(twin, dst)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)


def test_release_formats_are_stored(fp8_ckpt):
    raw = load_file(str(fp8_ckpt / "model.safetensors"))
    table = raw["layers.1.engram.embed.weight"]
    assert table.dtype == torch.float8_e4m3fn and raw["layers.1.engram.embed.scale"].shape == (152, 1)
    assert raw["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.2.attn.wq_a.scale"].shape == (2, 8)  # 64x256 in 32x32 blocks
    assert raw["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert raw["layers.0.ffn.experts.0.w1.scale"].shape == (64, 256 // 32)
    assert raw["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.2.attn.compressor.wkv.weight"].dtype == torch.bfloat16  # as released
    bf16 = load_model(fp8_ckpt, dtype=torch.bfloat16)
    assert bf16.layers[2].attn.compressor.wkv.weight.dtype == torch.float32  # ratio 2 pools in fp32
    assert bf16.layers[4].attn.compressor.wkv.weight.dtype == torch.bfloat16  # ratio 1: plain projection
    assert (
        bf16.head.weight.dtype == torch.float32
        and bf16.layers[1].engram.embed.weight.dtype == torch.float8_e4m3fn
    )


def test_fp8_checkpoint_matches_its_dequantized_twin(fp8_ckpt, tmp_path):
    _compare_with_twin(fp8_ckpt, tmp_path)


def test_engram_rows_with_several_scale_blocks(tmp_path):
    """Engram head_dim 64: two ue8m0 scales per row, so their order matters."""
    ckpt = make_tiny_checkpoint(tmp_path / "q", arch="deepseek_v41", seed=4, quant="fp8", engram_head_dim=64)
    assert load_file(str(ckpt / "model.safetensors"))["layers.1.engram.embed.scale"].shape == (152, 2)
    _compare_with_twin(ckpt, tmp_path / "twin")


def test_flat_reference_config_loads_the_fp8_checkpoint(fp8_ckpt, tmp_path):
    """``inference/config.json`` names (no quantization_config block; ``dtype: fp8``) still
    read the 32x32 weight blocks."""
    shutil.copytree(fp8_ckpt, tmp_path, dirs_exist_ok=True)
    text = json.loads((fp8_ckpt / "config.json").read_text())["text_config"]
    flat = {
        "dim": text["hidden_size"],
        "n_layers": text["num_hidden_layers"],
        "n_heads": text["num_attention_heads"],
        "moe_inter_dim": text["moe_intermediate_size"],
        "n_activated_experts": text["num_experts_per_tok"],
        "rope_head_dim": text["qk_rope_head_dim"],
        "norm_eps": text["rms_norm_eps"],
        "window_size": text["sliding_window"],
        "kv_source_layers": text["kv_source_layer_ids"],
        "index_source_layers": text["index_source_layer_ids"],
        "candidate_source_layer": text["candidate_source_layer_id"],
        "n_mtp_layers": text["num_nextn_predict_layers"],
        "engram_pad_id": text["engram_pad_token_id"],
        "dspark_n_activated_experts": text["dspark_num_experts_per_tok"],
        "rope_factor": text["rope_scaling"]["factor"],
        "original_seq_len": text["rope_scaling"]["original_max_position_embeddings"],
        "dtype": "fp8",
        "weight_block_size": [32, 32],
    }
    renamed = set(flat) | {"hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size"}
    flat |= {k: v for k, v in text.items() if k not in renamed and k not in ("rope_scaling", "model_type")}
    for ours in (
        "num_experts_per_tok",
        "qk_rope_head_dim",
        "rms_norm_eps",
        "sliding_window",
        "kv_source_layer_ids",
    ):
        flat.pop(ours)
    for ours in ("index_source_layer_ids", "candidate_source_layer_id", "num_nextn_predict_layers"):
        flat.pop(ours)
    flat.pop("engram_pad_token_id")
    flat.pop("dspark_num_experts_per_tok")
    (tmp_path / "config.json").write_text(json.dumps(flat))
    ids = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path)(ids).logits, load_model(fp8_ckpt)(ids).logits)


def _compare_with_twin(fp8_ckpt, tmp_path) -> None:
    _dequantized_twin(fp8_ckpt, tmp_path)
    ids = torch.randint(0, 258, (2, 37), generator=torch.Generator().manual_seed(0))
    quantized_model = load_model(fp8_ckpt)
    assert quantized_model.layers[1].engram.embed.weight.dtype == torch.float8_e4m3fn
    assert quantized_model.layers[3].engram.embed.scale is not None
    twin_model = load_model(tmp_path)
    assert twin_model.layers[1].engram.embed.weight.dtype == torch.float32
    for name, p in twin_model.named_parameters():
        if ".engram.embed." not in name:
            assert torch.equal(p.float(), quantized_model.get_parameter(name).float()), name
    with torch.no_grad():
        diff = (quantized_model(ids).logits - twin_model(ids).logits).abs().max()
    assert diff <= 1e-5


def test_dspark_stages_load_and_vision_keys_are_skipped(fp8_ckpt, tmp_path, caplog):
    shutil.copytree(fp8_ckpt, tmp_path, dirs_exist_ok=True)
    raw = load_file(str(fp8_ckpt / "model.safetensors"))
    raw["vision.blocks.0.attn.wqkv.weight"] = torch.zeros(4, 4)
    raw["aligner.w1.weight"] = torch.zeros(2, 2)
    raw["layers.0.ffn.gate.bias_vl"] = torch.zeros(8)
    write_safetensors(raw, tmp_path)
    with caplog.at_level(logging.WARNING):
        model = load_model(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "skipped 3" in lines[0]
    assert len(model.mtp) == 3
    stage0, last = model.mtp[0], model.mtp[-1]
    assert stage0.main_proj.weight.shape == (256, 3 * 256)
    assert last.markov_head.head.weight.shape == (258, 16)
    assert last.confidence_head.proj.weight.dtype == torch.float32
    assert len(stage0.ffn.experts) == 4 and stage0.ffn.gate.top_k == 1
    assert torch.isfinite(model.mtp[1].attn.wq_a.weight).all()


def test_missing_dspark_weights_are_reported(fp8_ckpt, tmp_path):
    shutil.copytree(fp8_ckpt, tmp_path, dirs_exist_ok=True)
    raw = {
        k: v for k, v in load_file(str(fp8_ckpt / "model.safetensors")).items() if not k.startswith("mtp.2.")
    }
    write_safetensors(raw, tmp_path)
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path)
