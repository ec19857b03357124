"""The adapters ``deepinfer serve --lora-modules`` loads at start, as vLLM spells them:
``name=path``, or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}``
(``base_model_name`` is optional: the ``parent`` ``/v1/models`` reports). No web framework
here: the command-line parser reads these before the server is imported."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraModule:
    """One adapter to serve by name from a PEFT directory."""

    name: str
    path: str
    base_model_name: str | None = None


_JSON_KEYS = {"name", "path", "base_model_name"}


def parse_lora_module(text: str) -> LoraModule:
    """``name=path`` or the JSON form; raises ``ValueError`` saying which part is wrong."""
    if text.lstrip().startswith("{"):
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected name=path or a JSON object, got {text!r}")
    return LoraModule(name, path)


def _from_json(text: str) -> LoraModule:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _JSON_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: name, path, base_model_name)")
    for key in ("name", "path"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise ValueError(f"{key!r} must be a non-empty string in {text!r}")
    parent = value.get("base_model_name")
    if parent is not None and (not isinstance(parent, str) or not parent):
        raise ValueError(f"'base_model_name' must be a non-empty string in {text!r}")
    return LoraModule(value["name"], value["path"], parent)
