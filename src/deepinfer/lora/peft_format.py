"""Reading a PEFT LoRA adapter directory and checking it against the served model.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``,
``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors`` whose keys are
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]. A
module's update is ``scale * B @ A`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` under
rsLoRA). Everything is checked before anything is kept, so a bad adapter changes nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class ModuleUpdate:
    """One linear's low-rank update: ``scale * b @ a``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: its updates by the served model's module names."""

    path: Path
    updates: dict[str, ModuleUpdate]
    base_model: str | None

    @property
    def rank(self) -> int:
        return max(u.rank for u in self.updates.values())


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key matching the end of
    the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json``, with the fields we cannot serve refused by name."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"lora_path {str(path)!r}: no {CONFIG_FILE} (is it a PEFT LoRA adapter directory?)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} must hold an object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"lora_path {str(path)!r}: peft_type {kind!r} is not a LoRA adapter")
    for field, plain in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(field, plain) not in (plain, None):
            raise ValueError(f"lora_path {str(path)!r}: {field}={config[field]!r} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"lora_path {str(path)!r}: modules_to_save={config['modules_to_save']!r} (whole trained "
            "copies of base modules) is not supported"
        )
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"lora_path {str(path)!r}: {field} must be a positive number, got {value!r}")
    return config


def read_adapter(
    path: str | Path, linears: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> Adapter:
    """Read and check the adapter at ``path`` against ``linears`` (the served model's target
    module names -> (in, out) features); raises ``ValueError`` naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"lora_path {str(path)!r} is not a directory")
    config = read_config(path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"lora_path {str(path)!r}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"lora_path {str(path)!r}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            raise ValueError(f"lora_path {str(path)!r}: tensor {key!r} is not a LoRA A or B weight")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise ValueError(f"lora_path {str(path)!r}: {WEIGHTS_FILE} holds no LoRA weights")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora", False))
    updates = {}
    for module, pair in sorted(parts.items()):
        if module not in linears:
            raise ValueError(
                f"lora_path {str(path)!r}: target module {module!r} is not a linear this model serves "
                f"adapters on (targets: {_describe(linears)})"
            )
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_path {str(path)!r}: {module!r} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        in_f, out_f = linears[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise ValueError(
                f"lora_path {str(path)!r}: base-model mismatch at {module!r}: lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, while the served linear is [{out_f}, {in_f}] (an adapter "
                "trained on another model?)"
            )
        if rank > max_rank:
            raise ValueError(
                f"lora_path {str(path)!r}: rank {rank} at {module!r} is above max_lora_rank={max_rank}"
            )
        module_r = _pattern_value(config.get("rank_pattern") or {}, module, r)
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scale = module_alpha / (math.sqrt(module_r) if rslora else module_r)
        updates[module] = ModuleUpdate(a.to(dtype), b.to(dtype), float(scale))
    return Adapter(path, updates, config.get("base_model_name_or_path"))


def _describe(linears: dict[str, tuple[int, int]]) -> str:
    """The target names without layer and expert numbers, for an error message."""
    kinds = sorted({re.sub(r"\.\d+\.", ".N.", name) for name in linears})
    return ", ".join(kinds[:12]) + (", ..." if len(kinds) > 12 else "")
