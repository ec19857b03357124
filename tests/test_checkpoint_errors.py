"""Every bad-checkpoint case raises CheckpointError naming the tensor and/or file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import CheckpointError, load_model


@pytest.fixture
def ckpt(v4_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(v4_ckpt, dst)
    return dst


def _edit(ckpt: Path, fn) -> None:
    state = load_file(str(ckpt / "model.safetensors"))
    fn(state)
    save_file(state, str(ckpt / "model.safetensors"))


def test_missing_tensor_is_named(ckpt):
    _edit(ckpt, lambda s: s.pop("layers.2.attn.compressor.ape"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.2\.attn\.compressor\.ape"):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _edit(ckpt, lambda s: s.update({"layers.0.attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected.*layers\.0\.attn\.bogus\.weight.*model\.safetensors"
    ):
        load_model(ckpt)


def test_mtp_tensors_are_ignored(ckpt):
    _edit(ckpt, lambda s: s.update({"mtp.0.enorm.weight": torch.ones(64)}))
    load_model(ckpt)


def test_wrong_shape_is_named(ckpt):
    _edit(ckpt, lambda s: s.update({"layers.1.attn.wkv.weight": torch.zeros(63, 64)}))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wkv\.weight.*shape \(63, 64\)"):
        load_model(ckpt)


def test_wrong_dtype_is_named(ckpt):
    _edit(ckpt, lambda s: s.update({"norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"norm\.weight.*dtype torch\.int32"):
        load_model(ckpt)
    _edit(
        ckpt,
        lambda s: s.update({"norm.weight": torch.ones(64), "layers.0.ffn.gate.tid2eid": torch.zeros(258, 2)}),
    )
    with pytest.raises(CheckpointError, match=r"tid2eid.*integer"):
        load_model(ckpt)


def test_fp8_weight_without_scale(ckpt):
    _edit(
        ckpt,
        lambda s: s.update(
            {"layers.1.attn.wq_a.weight": s["layers.1.attn.wq_a.weight"].to(torch.float8_e4m3fn)}
        ),
    )
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.attn\.wq_a\.weight.*no 'layers\.1\.attn\.wq_a\.scale'"
    ):
        load_model(ckpt)


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(ckpt)


def test_corrupt_header(ckpt):
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\x00not json at all, broken header!"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(ckpt)


def test_config_that_does_not_match_the_weights(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does config.json match these weights"):
        load_model(ckpt)


def test_config_with_more_layers_than_weights(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 6
    config["compress_ratios"] = [0, 4, 128, 4, 0, 0, 0]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.5\."):
        load_model(ckpt)


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(ckpt)


def test_invalid_config_values(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["compress_ratios"] = [0, 3, 128, 4, 0, 0]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="compress ratio 3"):
        load_model(ckpt)


def test_missing_shard_named_by_index(v4_short_ckpt, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(v4_short_ckpt, dst)
    victim = sorted(dst.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{victim.name}'.*missing"):
        load_model(dst)


def test_missing_directory_and_no_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2, "compress_ratios": [0, 0]}
        )
    )
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model(tmp_path)


def test_unsupported_architecture(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="FancyNetForCausalLM"):
        load_model(ckpt)
