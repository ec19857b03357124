"""Load a checkpoint directory into a model built on the meta device.

Tensors are read one at a time from memory-mapped safetensors files and assigned in place,
so peak RAM stays near the size of the loaded model. Every failure names the tensor and the
file, because a user with a 300 GB checkpoint needs to know which shard is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from deepinfer.errors import CheckpointError
from deepinfer.models.registry import resolve
from deepinfer.weights.quant import PACKED_FP4_DTYPES, dequantize_fp4, dequantize_fp8_blocks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoint prefixes this model does not use (the MTP/draft layers load with spec decoding).
IGNORED_PREFIXES = ("mtp.",)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the file holding it (from the index json, or by scanning)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index (need a 'weight_map')") from exc
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{index} names shard {shard!r}, which is missing from {path}")
        return {name: path / shard for name, shard in weight_map.items()}
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}) in {path}")
    names: dict[str, Path] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                names[name] = file
    return names


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file (truncated or corrupt?): {exc}") from exc


class _Reader:
    """Keeps one open handle per shard and reads tensors with clear errors."""

    def __init__(self, names: dict[str, Path]) -> None:
        self.names = names
        self._handles: dict[Path, Any] = {}

    def file_of(self, name: str) -> Path:
        return self.names[name]

    def get(self, name: str) -> torch.Tensor:
        file = self.names[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles.setdefault(file, _open(file))
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {exc}") from exc
        except Exception as exc:  # safetensors reports a name missing from a shard this way
            raise CheckpointError(f"{file}: tensor {name!r} listed in the index is not in the file") from exc


def _fp8_block(quant: dict[str, Any] | None) -> tuple[int, int]:
    block = (quant or {}).get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _read_weight(reader: _Reader, name: str, quant: dict[str, Any] | None) -> tuple[torch.Tensor, set[str]]:
    """Read ``name``, dequantizing fp8/fp4 storage with its ``.scale`` companion."""
    raw = reader.get(name)
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    quantized = raw.dtype == torch.float8_e4m3fn or raw.dtype in PACKED_FP4_DTYPES
    if not quantized:
        return raw, set()
    if scale_name is None or scale_name not in reader.names:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name!r} is stored as {raw.dtype} but has no "
            f"{scale_name or name + '.scale'!r} scale tensor"
        )
    scale = reader.get(scale_name)
    try:
        if raw.dtype == torch.float8_e4m3fn:
            return dequantize_fp8_blocks(raw, scale, _fp8_block(quant)), {scale_name}
        return dequantize_fp4(raw, scale), {scale_name}
    except ValueError as exc:
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r}: {exc}") from exc


def _check_dtype(name: str, file: Path, tensor: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.is_floating_point() and not tensor.is_floating_point():
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected a floating dtype")
    if not expected.is_floating_point() and tensor.is_floating_point():
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected an integer dtype")


def load_weights(model: nn.Module, path: Path, dtype: torch.dtype, device: torch.device, quant: Any) -> None:
    """Fill a meta-device ``model`` from the checkpoint at ``path`` (strict: all and only)."""
    reader = _Reader(checkpoint_files(path))
    expected = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = sorted(n for n in expected if n not in reader.names)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {shown} "
            "(does config.json match these weights?)"
        )
    consumed: set[str] = set()
    markers = getattr(model, "FP32_PARAM_MARKERS", ())
    for name, slot in expected.items():
        tensor, scales = _read_weight(reader, name, quant)
        consumed |= scales | {name}
        file = reader.file_of(name)
        _check_dtype(name, file, tensor, slot)
        if tuple(tensor.shape) != tuple(slot.shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(slot.shape)} (does config.json match these weights?)"
            )
        if slot.is_floating_point():
            target = torch.float32 if any(m in name for m in markers) else dtype
            tensor = tensor.to(device=device, dtype=target)
        else:
            tensor = tensor.to(device=device, dtype=slot.dtype)
        _assign(model, name, tensor)
    unexpected = sorted(
        n for n in reader.names if n not in consumed and not n.startswith(IGNORED_PREFIXES)
    )
    if unexpected:
        shown = ", ".join(f"{n!r} ({reader.file_of(n).name})" for n in unexpected[:5])
        raise CheckpointError(
            f"{path}: {len(unexpected)} unexpected tensor(s) in the checkpoint, e.g. {shown} "
            "(does config.json match these weights?)"
        )


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build the architecture named in ``config.json`` and load its weights.

    Returns an ``nn.Module`` in eval mode; ``model(input_ids)`` gives full fp32 logits.
    """
    from deepinfer.config import load_config_json

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    raw = load_config_json(path)
    cfg, cls = resolve(raw)
    with torch.device("meta"):
        model = cls(cfg)
    load_weights(model, path, dtype, torch.device(device), raw.get("quantization_config"))
    return model.eval()
