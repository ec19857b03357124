"""lm-eval's ``--model_args`` (``key=value,...``) as ``LLM`` engine options: each value is
converted to its ``EngineConfig`` field's type, so ``kv_cache_dtype=fp8``,
``max_model_len=512`` and ``enable_prefix_caching=false`` mean what they say, and
``quantization=none`` stays the string the option defines (lm-eval's own parser would turn it
into ``None``)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from deepinfer.config import EngineConfig

_TRUE = {"true", "yes", "1"}
_FALSE = {"false", "no", "0"}


def split_arg_string(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``; the values stay text (converted per field
    later). A value may hold ``=``; surrounding quotes are removed."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"model_args: {item!r} is not key=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


@functools.cache
def engine_option_types() -> dict[str, tuple[type, ...]]:
    """``EngineConfig`` field -> the plain types it accepts (``NoneType`` among them if it may
    be None)."""
    hints = typing.get_type_hints(EngineConfig)
    found: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(EngineConfig):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) else ()
        found[f.name] = tuple(typing.get_origin(a) or a for a in args) if args else (hint,)
    return found


def convert(name: str, value: Any, accepted: tuple[type, ...]) -> Any:
    """``value`` (text from the command line, or a typed value from a dict) as the field's type."""
    if typing.Any in accepted:  # a structured option (speculative_config): LLM checks it
        return value
    if not isinstance(value, str):
        if value is None and type(None) in accepted:
            return None
        if isinstance(value, bool):
            if bool in accepted:
                return value
        elif isinstance(value, int) and (int in accepted or float in accepted):
            return value if int in accepted else float(value)
        elif isinstance(value, float) and float in accepted:
            return value
        elif isinstance(value, float) and int in accepted and value.is_integer():
            return int(value)
        elif isinstance(value, str | list | dict) and type(value) in accepted:
            return value
        raise ValueError(f"model_args: {name} must be {_names(accepted)}, got {value!r}")
    text = value.strip()
    if str in accepted:
        return text
    if type(None) in accepted and text.lower() == "none":
        return None
    if bool in accepted:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    if int in accepted:
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
            if number is not None and number.is_integer():
                return int(number)
    if float in accepted:
        try:
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"model_args: {name} must be {_names(accepted)}, got {value!r}")


def _names(accepted: tuple[type, ...]) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in accepted)


def engine_options(args: dict[str, Any]) -> dict[str, Any]:
    """``LLM`` keyword arguments from ``args``, each converted to its field's type; an unknown
    name is an error listing the known ones."""
    kinds = engine_option_types()
    unknown = sorted(set(args) - set(kinds))
    if unknown:
        raise ValueError(
            f"model_args: unknown option(s) {', '.join(unknown)}; the engine's are {', '.join(sorted(kinds))}"
        )
    return {name: convert(name, value, kinds[name]) for name, value in args.items()}
