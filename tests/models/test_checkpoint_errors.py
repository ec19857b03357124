"""Every bad-checkpoint case raises CheckpointError naming the tensor and/or file."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import CheckpointError, load_model
from deepinfer.weights import loader


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


def _rewrite(file: Path, mutate) -> str:
    """Rewrite a safetensors file's header (and data) with ``mutate(header, spans, data)``,
    which returns (header, data, name of the tensor at fault or None)."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    spans = sorted((info["data_offsets"][0], name) for name, info in header.items() if name != "__metadata__")
    header, data, victim = mutate(header, [name for _, name in spans], data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return victim


def _set(name: str, key: str, value):
    def mutate(header, order, data):
        target = order[0] if name == "first" else order[-1] if name == "last" else order[1]
        header[target][key] = value(header[target][key])
        return header, data, target

    return mutate


def _truncate(header, order, data):
    half = len(data) // 2
    victim = next(n for n in order if header[n]["data_offsets"][1] > half)
    return header, data[:half], victim


MALFORMED = {
    "negative offset": _set("first", "data_offsets", lambda o: [-8, o[1]]),
    "overlapping tensors": _set("second", "data_offsets", lambda o: [o[0] - 4, o[1] - 4]),
    "offsets past the end": _set("last", "data_offsets", lambda o: [o[0] + 64, o[1] + 64]),
    "wrong byte size": _set("first", "shape", lambda s: [s[0] + 1, *s[1:]]),
    "string offsets": _set("first", "data_offsets", lambda o: [str(o[0]), str(o[1])]),
    "bad dtype": _set("second", "dtype", lambda d: "F33"),
    "negative dimension": _set("last", "shape", lambda s: [-1, *s[1:]]),
    "truncated shard": _truncate,
    "list header": lambda header, order, data: (list(header.items()), data, None),
    "string header": lambda header, order, data: ("weights", data, None),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_shard_is_a_checkpoint_error_and_nothing_is_read(
    v4_short_ckpt, tmp_path, case, monkeypatch
):
    """Each malformed header (the last of three shards) ends in a CheckpointError naming the
    file and, where one is at fault, the tensor; no tensor of any shard is read first."""
    dst = tmp_path / "sharded"
    shutil.copytree(v4_short_ckpt, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    victim = _rewrite(shard, MALFORMED[case])
    reads = []
    real = loader.SafetensorsFile.read
    monkeypatch.setattr(
        loader.SafetensorsFile, "read", lambda self, name: reads.append(name) or real(self, name)
    )
    with pytest.raises(CheckpointError) as info:
        load_model(dst)
    assert shard.name in str(info.value)
    if victim is not None:
        assert repr(victim) in str(info.value)
    assert reads == []


def test_sharded_checkpoint_still_loads_and_reads_each_tensor_once(v4_short_ckpt, monkeypatch):
    """The control for the test above: the untouched copy loads, reading every tensor once."""
    reads = []
    real = loader.SafetensorsFile.read
    monkeypatch.setattr(
        loader.SafetensorsFile, "read", lambda self, name: reads.append(name) or real(self, name)
    )
    load_model(v4_short_ckpt)
    assert len(reads) == len(set(reads)) == len(loader.checkpoint_files(v4_short_ckpt))
