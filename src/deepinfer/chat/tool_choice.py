"""``tool_choice`` for DeepSeek-V4/V4.1: which replies a request allows, as an xgrammar
structural tag over the DSML tool-call block.

- ``"required"``: the reply (after the reasoning, in thinking mode) is one tool-call block of
  one or more calls to the request's tools; a named function (``{"type": "function",
  "function": {"name": ...}}``): one call to that function. Every call's arguments follow its
  tool's JSON schema (``strict`` or not: a forced call is always checked).
- ``"auto"`` with a tool marked ``strict: true``: text as the model likes, but once it opens a
  tool-call block the block is well-formed DSML, its calls name the request's tools and a strict
  tool's arguments follow its schema (the other tools' arguments are any JSON values).
- ``"auto"`` with no strict tool, and ``"none"``: nothing is enforced (None).

The grammar is xgrammar's own DeepSeek-V4 template (``get_model_structural_tag``): the markup it
allows is the markup ``deepseek.py`` renders and ``deepseek_parser.py`` reads (string
arguments as raw text with ``string="true"``, others as JSON with ``string="false"``). vLLM's
DeepSeek-V4 tool parser builds the same tag.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.chat.deepseek import V41, Dialect

_MODES = ("none", "auto", "required")


def named_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names (None for the string modes); ``ValueError`` naming
    ``tool_choice`` for anything else."""
    if tool_choice is None or tool_choice in _MODES:
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            return name
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(tool_choice)[:200]}'
    )


def _checked(functions: list[dict[str, Any]]) -> None:
    """Names the DSML markup can carry: a quote or a line break would end the ``name="..."``
    attribute early, so the call could not be read back."""
    for i, fn in enumerate(functions):
        if any(c in fn["name"] for c in '"<>\n'):
            raise ValueError(f"tools[{i}].function.name: {fn['name']!r} cannot be written in a DSML call")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict | bool):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        for key in (params or {}).get("properties", {}) if isinstance(params, dict) else ():
            if any(c in key for c in '"<>\n'):
                raise ValueError(
                    f"tools[{i}].function.parameters.properties: {key!r} cannot be written as a "
                    "DSML parameter name"
                )


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def open_containers(schema: Any) -> Any:
    """``schema`` with every array that lists no items taking any items and every object that
    lists no properties taking any properties, as JSON Schema means them: xgrammar's structural
    tags read such containers strictly (``[]`` and ``{}`` only). An object that lists its
    properties keeps to them, as OpenAI's strict tools do."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "array" in types and "items" not in out and "prefixItems" not in out:
        out["items"] = True
    if "object" in types and not {"properties", "additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = True
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = open_containers(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [open_containers(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: open_containers(s) for k, s in out[key].items()}
    return out


def tool_call_tag(
    dialect: Dialect,
    functions: list[dict[str, Any]],
    tool_choice: Any,
    thinking: bool,
    parallel_tool_calls: bool = True,
) -> str | None:
    """The structural tag (its JSON text) that enforces ``tool_choice`` over ``functions``
    (the request's function definitions), or None where nothing is enforced (module
    docstring). ``ValueError`` names the field at fault."""
    import xgrammar as xgr

    name = named_function(tool_choice)
    mode = "auto" if tool_choice is None else tool_choice
    if mode == "none" or (mode == "auto" and not any(fn.get("strict") is True for fn in functions)):
        return None
    if not functions:
        raise ValueError(f"tool_choice: {json.dumps(tool_choice)} needs tools")
    if name is not None and name not in [fn["name"] for fn in functions]:
        raise ValueError(f"tool_choice: no tool is named {name!r}")
    _checked(functions)
    forced = mode != "auto"
    tools = []
    for fn in functions:
        # a forced call checks every tool's schema; under auto only the strict tools' schemas
        strict = True if forced else fn.get("strict") is True
        function = {**fn, "strict": strict}
        if isinstance(fn.get("parameters"), dict):
            function["parameters"] = open_containers(fn["parameters"])
        tools.append({"type": "function", "function": function})
    try:
        tag = xgr.get_model_structural_tag(
            "deepseek_v4_1" if dialect is V41 else "deepseek_v4",
            tools=tools,
            tool_choice=tool_choice,
            reasoning="enabled" if thinking else "disabled",
            parallel_tool_calls=parallel_tool_calls,
        )
    except ValueError as exc:  # pydantic's ValidationError is one too
        raise ValueError(f"tools: {str(exc).splitlines()[0]}") from exc
    return tag.model_dump_json()
