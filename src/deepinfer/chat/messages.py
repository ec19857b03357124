"""OpenAI chat messages and tool definitions checked and reduced to plain dicts, with errors that
name the message and field (``messages[2].tool_calls[0].function.arguments``)."""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_of(content: Any, where: str, joiner: str = "") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(f"{where}.content[{i}]: only text parts are supported")
            parts.append(part["text"])
        return joiner.join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def tool_arguments(raw: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments as a dict: OpenAI sends a JSON object as a string."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from exc
        if isinstance(value, dict):
            return value
    raise ValueError(f"{where} must be a JSON object")


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a list")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        calls.append(
            {
                "id": call.get("id") or "",
                "name": fn["name"],
                "arguments": tool_arguments(fn.get("arguments", "{}"), f"{at}.function.arguments"),
            }
        )
    return calls


def normalize_messages(messages: list[Any], joiner: str = "") -> list[dict[str, Any]]:
    """Plain dicts with string content (OpenAI text parts joined with ``joiner``); an
    assistant's ``tool_calls`` become ``{"id", "name", "arguments": dict}``; ``reasoning`` is
    read as ``reasoning_content``. Roles are OpenAI's (a role is written into the prompt, so
    free text there could open a turn)."""
    out = []
    for i, m in enumerate(messages):
        raw = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        role = raw.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        msg = dict(raw)
        msg["content"] = _text_of(raw.get("content"), f"messages[{i}]", joiner)
        if raw.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(raw["tool_calls"], f"messages[{i}].tool_calls")
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"messages[{i}].reasoning_content must be a string")
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI ``tools`` (``[{"type": "function", "function": {"name", ...}}]``) checked; the
    function definitions are returned as given."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        raw = tool if isinstance(tool, dict) else tool.model_dump(exclude_none=True)
        fn = raw.get("function")
        if raw.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        out.append(fn)
    return out
