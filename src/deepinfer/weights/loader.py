"""Load a checkpoint directory into a model built on the meta device (``load_weights``).

Tensors are read one at a time from safetensors files (by the ``safetensors`` library, which
also validates every header; see ``SafetensorsFile``) and assigned in place, so peak RAM stays
near the size of the loaded model. Every failure names the tensor and the
file, because a user with a 300 GB checkpoint needs to know which shard is wrong.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from deepinfer.errors import CheckpointError
from deepinfer.weights.quant import PACKED_FP4_DTYPES, dequantize_fp4, dequantize_fp8_blocks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
logger = logging.getLogger(__name__)


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
        for name in SafetensorsFile(file).entries:
            names[name] = file
    return names


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,  # two e2m1 values per byte; the header counts values
}
# bytes read through one open handle before it is reopened: pages of its memory map that were
# copied out stay in our resident set until the map is closed
_REMAP_BYTES = 16 << 20


class SafetensorsFile:
    """One ``.safetensors`` file, validated and read by the ``safetensors`` library.

    The library checks the header when the file is opened (a JSON object, known dtypes,
    non-negative integer offsets that tile the data exactly, sizes matching shapes), so a
    truncated or corrupt file fails before any tensor is read; its message is turned into a
    ``CheckpointError`` naming the file and, where one is at fault, the tensor. Tensors are
    copied out of the library's memory map one at a time and the map is reopened every
    ``_REMAP_BYTES``, so peak RAM stays at the tensors we keep (tests/models/test_load_memory.py).
    """

    def __init__(self, file: Path) -> None:
        self.file = file
        self.entries: dict[str, tuple[torch.dtype, list[int]]] = {}
        self._handle: Any = None
        self._mapped = 0
        with self._open() as f:
            for name in f.keys():
                piece = f.get_slice(name)
                stored = piece.get_dtype()
                if stored not in _DTYPES:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has dtype {stored}, which deepinfer does not read"
                    )
                self.entries[name] = (_DTYPES[stored], list(piece.get_shape()))

    def _open(self) -> Any:
        try:
            return safe_open(str(self.file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"{self.file}: unreadable safetensors file (truncated or corrupt?): {exc}{_diagnose(self.file)}"
            ) from exc

    def read(self, name: str) -> torch.Tensor:
        """A copy of tensor ``name`` in memory of its own (not the file's map)."""
        if self._handle is None or self._mapped >= _REMAP_BYTES:
            self.close()
            self._handle = self._open().__enter__()
        try:
            view = self._handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.file}: tensor {name!r} could not be read: {exc}") from exc
        out = torch.empty_like(view)
        out.copy_(view)
        self._mapped += out.nbytes
        return out

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._mapped = None, 0


def _diagnose(file: Path) -> str:
    """Which tensor of a file the library rejected, and why (for the error message; the
    library's own message does not always say). Empty when the header cannot be parsed."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 100 << 20)))
        data = file.stat().st_size - 8 - length
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(header, dict):
        return f" (the header is a JSON {type(header).__name__}, not an object)"
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(info, data)
        if problem:
            return f" (tensor {name!r}: {problem})"
        spans.append((*info["data_offsets"], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            return f" (tensor {name!r} {'overlaps the one before it' if begin < end else 'leaves a gap before it'})"
        end = stop
    return f" ({data - end} bytes after the last tensor)" if end != data else ""


def _entry_problem(info: Any, data: int) -> str:
    if not isinstance(info, dict):
        return "its entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    ):
        return f"data_offsets {offsets!r} are not two non-negative integers"
    bits = 4 if dtype == "F4" else torch.empty(0, dtype=_DTYPES[dtype]).element_size() * 8
    nbytes = math.ceil(math.prod(shape) * bits / 8)
    if offsets[1] - offsets[0] != nbytes:
        return f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, shape {shape} of {dtype} needs {nbytes}"
    if offsets[1] > data:
        return f"data_offsets {offsets} end past the file's {data} data bytes"
    return ""


class _Reader:
    """Reads tensors by name across the shards of a checkpoint. Every shard's header is
    checked, and every indexed name looked up in its shard, before any tensor is read: a
    malformed checkpoint fails with nothing loaded."""

    def __init__(self, names: dict[str, Path]) -> None:
        self.names = names
        self._files = {file: SafetensorsFile(file) for file in sorted(set(names.values()))}
        for name, file in names.items():
            if name not in self._files[file].entries:
                raise CheckpointError(f"{file}: tensor {name!r} listed in the index is not in the file")

    def file_of(self, name: str) -> Path:
        return self.names[name]

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype, from the file header (nothing is read)."""
        return self._files[self.names[name]].entries[name][0]

    def get(self, name: str) -> torch.Tensor:
        return self._files[self.names[name]].read(name)

    def close(self) -> None:
        for shard in self._files.values():
            shard.close()


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


class LoadableModel(Protocol):
    """What the loader asks of a model: the ``nn.Module`` calls it makes and the hooks every
    ``deepinfer.models.base.CausalLM`` declares with defaults."""

    ignored_checkpoint_prefixes: tuple[str, ...]
    skipped_checkpoint_prefixes: tuple[str, ...]
    skipped_checkpoint_suffixes: tuple[str, ...]
    optional_checkpoint_prefix: str | None

    def keeps_fp32(self, name: str) -> bool: ...
    def keeps_stored(self, name: str) -> bool: ...
    def keep_stored(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
    ) -> None: ...
    def drop_optional_layers(self) -> None: ...
    def state_dict(self, *, keep_vars: bool) -> dict[str, Any]: ...
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def get_submodule(self, target: str) -> nn.Module: ...


def load_weights(
    model: LoadableModel, path: Path, dtype: torch.dtype, device: torch.device, quant: Any
) -> None:
    """Fill a meta-device ``model`` from the checkpoint at ``path`` (strict: all and only)."""
    reader = _Reader(checkpoint_files(path))
    try:
        _load_all(model, reader, path, dtype, device, quant)
    finally:
        reader.close()


def _load_all(
    model: LoadableModel, reader: _Reader, path: Path, dtype: torch.dtype, device: torch.device, quant: Any
) -> None:
    persistent = set(model.state_dict(keep_vars=True))  # not runtime buffers (stacked experts)
    expected = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in persistent}
    missing = sorted(n for n in expected if n not in reader.names)
    optional = model.optional_checkpoint_prefix
    if missing and optional is not None and all(n.startswith(optional) for n in missing):
        # a checkpoint without its draft layers (converted or trimmed): serve without them
        drafts = sorted(n for n in expected if n.startswith(optional))
        if len(missing) == len(drafts):
            logger.warning(
                "%s: no %s* tensors; speculative decoding with mtp/dspark is unavailable", path, optional
            )
            model.drop_optional_layers()
            expected = {n: t for n, t in expected.items() if not n.startswith(optional)}
            missing = []
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {shown} "
            "(does config.json match these weights?)"
        )
    consumed: set[str] = set()
    for name, slot in expected.items():
        if _keep_stored(model, reader, name, device, quant):
            consumed |= {name, name[: -len("weight")] + "scale"}
            continue
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
            target = torch.float32 if model.keeps_fp32(name) else dtype
            tensor = tensor.to(device=device, dtype=target)
        else:
            tensor = tensor.to(device=device, dtype=slot.dtype)
        _assign(model, name, tensor)
    skip_prefixes, skip_suffixes = model.skipped_checkpoint_prefixes, model.skipped_checkpoint_suffixes
    skipped = [n for n in reader.names if n.startswith(skip_prefixes) or n.endswith(skip_suffixes)]
    if skipped:
        logger.warning(
            "%s: skipped %d vision tensor(s) (%s...): deepinfer serves this model as text only",
            path,
            len(skipped),
            ", ".join(sorted(skipped)[:2]),
        )
    consumed |= set(skipped)
    ignored = model.ignored_checkpoint_prefixes
    unexpected = sorted(n for n in reader.names if n not in consumed and not n.startswith(ignored))
    if unexpected:
        shown = ", ".join(f"{n!r} ({reader.file_of(n).name})" for n in unexpected[:5])
        raise CheckpointError(
            f"{path}: {len(unexpected)} unexpected tensor(s) in the checkpoint, e.g. {shown} "
            "(does config.json match these weights?)"
        )


def read_checkpoint(model: LoadableModel, path: Path, quant: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint at ``path`` that ``model`` holds, as read (fp8 and fp4
    dequantized with their scales), all read before the caller writes any
    (``LLM.load_weights_from_disk``). A tensor the model does not hold raises as loading
    does; tensors the checkpoint lacks are not part of the update."""
    reader = _Reader(checkpoint_files(path))
    try:
        held = set(model.state_dict(keep_vars=True))
        found: list[tuple[str, torch.Tensor]] = []
        consumed: set[str] = set()
        for name in sorted(reader.names):
            if name in held:
                tensor, scales = _read_weight(reader, name, quant)
                consumed |= scales | {name}
                found.append((name, tensor))
        ignored = (*model.ignored_checkpoint_prefixes, *model.skipped_checkpoint_prefixes)
        unexpected = sorted(
            n
            for n in reader.names
            if n not in consumed
            and not n.startswith(ignored)
            and not n.endswith(model.skipped_checkpoint_suffixes)
        )
        if unexpected:
            raise CheckpointError(
                f"{path}: {len(unexpected)} tensor(s) this model does not hold, e.g. {unexpected[0]!r} "
                f"({reader.file_of(unexpected[0]).name})"
            )
        return found
    finally:
        reader.close()


def _keep_stored(
    model: LoadableModel, reader: _Reader, name: str, device: torch.device, quant: dict[str, Any] | None
) -> bool:
    """Hand a quantized tensor (fp8 e4m3, or packed fp4 with a scale) and its scale as stored
    to the model when it keeps them (Engram tables; with ``keep_quantized``, fp8 linears and
    fp4 routed experts) instead of dequantising on load."""
    stored = reader.dtype_of(name)
    if stored != torch.float8_e4m3fn and stored not in PACKED_FP4_DTYPES:
        return False
    scale_name = name[: -len("weight")] + "scale"
    if stored != torch.float8_e4m3fn and scale_name not in reader.names:
        return False  # a plain integer tensor
    if not model.keeps_stored(name):
        return False
    if scale_name not in reader.names:
        raise CheckpointError(f"{reader.file_of(name)}: {stored} tensor {name!r} has no {scale_name!r}")
    raw = reader.get(name)
    try:
        model.keep_stored(name, raw.to(device), reader.get(scale_name).to(device), _fp8_block(quant))
    except ValueError as exc:
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r}: {exc}") from exc
    return True


def _assign(model: LoadableModel, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    current = owner._parameters.get(leaf)
    if current is not None and not current.is_meta:  # preallocated storage (a stacked view)
        with torch.no_grad():
            current.copy_(tensor)
    elif leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor
