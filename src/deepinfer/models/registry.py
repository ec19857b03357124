"""``architectures`` in config.json -> (config parser, model class); reading config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.errors import CheckpointError
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4_config import deepseek_v4_config_from_dict
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41_config import deepseek_v41_config_from_dict, is_v41_config
from deepinfer.models.llama import LlamaForCausalLM, llama_config_from_dict

_ARCHITECTURES: dict[str, tuple[Callable[[dict[str, Any]], Any], type[CausalLM]]] = {
    "DeepseekV4ForCausalLM": (deepseek_v4_config_from_dict, DeepseekV4ForCausalLM),
    "DeepseekV41ForCausalLM": (deepseek_v41_config_from_dict, DeepseekV41ForCausalLM),
    "LlamaForCausalLM": (llama_config_from_dict, LlamaForCausalLM),
}


def resolve(raw_config: dict[str, Any]) -> tuple[Any, type[CausalLM]]:
    """Parse the config and pick the model class, or say which architectures exist."""
    archs = raw_config.get("architectures") or []
    model_type = raw_config.get("model_type")
    if not archs and is_v41_config(raw_config):  # text_config alone, or the flat inference/config.json
        archs = ["DeepseekV41ForCausalLM"]
    if not archs and model_type in ("deepseek_v4", "llama"):
        archs = ["DeepseekV4ForCausalLM" if model_type == "deepseek_v4" else "LlamaForCausalLM"]
    for arch in archs:
        if arch in _ARCHITECTURES:
            parse, cls = _ARCHITECTURES[arch]
            return parse(raw_config), cls
    raise CheckpointError(
        f"config.json: unsupported architectures {archs or model_type!r}; supported: {sorted(_ARCHITECTURES)}"
    )


def load_config_json(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint directory with a clear error when it is absent."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {Path(path)}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
