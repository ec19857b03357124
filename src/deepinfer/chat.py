"""Chat messages to prompt token ids through the checkpoint's chat template, with message
text that can never become a control token.

Rendering the template to one string and tokenizing it lets a user write ``<|im_end|>`` in a
message and end their turn, or open a ``system`` one. Instead each message's text is replaced
by a unique marker before rendering; the rendered template is split at the markers; the
template's own pieces are tokenized with special tokens recognised and the users' pieces with
them split into plain text (``split_special_tokens=True``). So the control tokens in the
prompt are exactly the ones the template wrote.
"""

from __future__ import annotations

import secrets
from typing import Any


def _text_of(content: Any, where: str) -> str:
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
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Plain dicts with string content (OpenAI text parts joined); errors name the message."""
    out = []
    for i, m in enumerate(messages):
        raw = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        role = raw.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        msg = dict(raw)
        msg["content"] = _text_of(raw.get("content"), f"messages[{i}]")
        out.append(msg)
    return out


def encode_chat(
    tokenizer: Any,
    messages: list[Any],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids for ``messages`` (see the module docstring for why the text is split)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: chat needs one")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this checkpoint's tokenizer has no chat template")
    msgs = normalize_messages(messages)
    markers: dict[str, str] = {}
    masked = []
    for m in msgs:
        marker = f"\x00{secrets.token_hex(8)}\x00"
        markers[marker] = m["content"]
        masked.append({**m, "content": marker})
    rendered = tokenizer.apply_chat_template(
        masked, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )
    ids: list[int] = []
    rest = rendered
    while rest:
        # the earliest marker still in the rendered text
        found = [(rest.find(mk), mk) for mk in markers if mk in rest]
        if not found:
            ids += tokenizer(rest, add_special_tokens=False).input_ids
            break
        pos, marker = min(found)
        if pos:
            ids += tokenizer(rest[:pos], add_special_tokens=False).input_ids
        text = markers[marker]
        if text:
            ids += tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
        rest = rest[pos + len(marker) :]
    return ids
