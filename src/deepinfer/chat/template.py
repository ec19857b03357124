"""Chat messages to prompt token ids through the checkpoint's chat template, with message
text that can never become a control token.

Rendering the template to one string and tokenizing it lets a user write ``<|im_end|>`` in a
message and end their turn, or open a ``system`` one. Instead each message's text is replaced
by a unique marker before rendering; the rendered template is split at the markers; the
template's own pieces are tokenized with special tokens recognised and the users' pieces with
no added token recognised at all (``plain.py``). So the control tokens in the prompt are
exactly the ones the template wrote.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from deepinfer.chat.messages import normalize_messages
from deepinfer.chat.plain import plain_ids

_MARKER = re.compile("\x00[0-9a-f]{16}\x00")


def _marker() -> str:
    return f"\x00{secrets.token_hex(8)}\x00"


def encode_chat(
    tokenizer: Any,
    messages: list[Any],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Prompt token ids for ``messages`` (see the module docstring for why the text is split)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: chat needs one")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this checkpoint's tokenizer has no chat template")
    msgs = normalize_messages(messages)
    if tools or any(m.get("tool_calls") for m in msgs):
        # tool calls and schemas would reach the template as unmasked text, and no parser reads
        # this format's calls back: refused rather than half supported
        raise ValueError("tools: this model's chat template has no tool-call support in deepinfer")
    markers: dict[str, str] = {}
    masked = []
    for m in msgs:
        marker = _marker()
        markers[marker] = m["content"]
        entry = {**m, "content": marker}
        if m.get("reasoning_content"):
            reasoning = _marker()
            markers[reasoning] = m["reasoning_content"]
            entry["reasoning_content"] = reasoning
        masked.append(entry)
    extra = dict(template_kwargs or {})
    rendered = tokenizer.apply_chat_template(
        masked, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    ids: list[int] = []
    start = 0
    # one pass over the rendered text: every marker has the same shape, and only the ones
    # made here count (template text that merely looks like one is template text)
    for found in _MARKER.finditer(rendered):
        text = markers.get(found.group())
        if text is None:
            continue
        if found.start() > start:
            ids += tokenizer(rendered[start : found.start()], add_special_tokens=False).input_ids
        if text:
            ids += plain_ids(tokenizer, text)
        start = found.end()
    if start < len(rendered):
        ids += tokenizer(rendered[start:], add_special_tokens=False).input_ids
    return ids
