"""A DeepSeek-V4/V4.1 reply read back into OpenAI fields: ``reasoning_content`` (up to
``</think>`` in thinking mode), ``content``, and ``tool_calls`` from the DSML blocks.

It reads the whole text so far on every call and sends only what can no longer change: text
that might be the start of ``</think>`` or of the tool-call block is held back until the next
piece decides it, so a streamed ``content`` never carries a fragment of markup (vLLM's V4
parser was reported to leak it). A tool call is announced (id and name) as soon as its name is
complete and its arguments are sent, as one JSON object, when its ``invoke`` closes; a reply
cut short (length) sends the arguments read so far. A ``string="false"`` argument is read as
JSON, so a closing tag inside one of its strings does not end it; whitespace between tags is
skipped (xgrammar's DSML grammar allows it). A block that is not valid DSML is given back as
content at the end rather than dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer.chat.deepseek import END_THINK, Dialect

_NAME = re.compile(r' name="([^"]*)">\n?')
_PARAM = re.compile(r' name="([^"]*)" string="(true|false)">')


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    complete: bool
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedReply:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def _held(text: str, markers: list[str], hold_space: bool) -> str:
    """``text`` less any ending that could still grow into one of ``markers`` (and, when the
    block may follow, the whitespace before it)."""
    cut = len(text)
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                cut = min(cut, len(text) - n)
                break
    kept = text[:cut]
    return kept.rstrip() if hold_space else kept


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON a client can read")


def _value(raw: str, is_string: bool) -> Any:
    if is_string:
        return raw
    try:  # NaN/Infinity and absurd nesting would break the client's JSON (or our parser)
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return raw  # not JSON after all: keep the text rather than fail the call


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _json_then(text: str, start: int, close: str) -> tuple[Any, int] | None:
    """The JSON value at ``start`` (whitespace around it allowed) when ``close`` follows it, and
    where ``close`` ends; None otherwise. Read as JSON, not up to the first ``close``: a string
    inside the value may hold the closing tag itself."""
    at = start
    while at < len(text) and text[at].isspace():
        at += 1
    try:
        value, end = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None
    while end < len(text) and text[end].isspace():
        end += 1
    return (value, end + len(close)) if text.startswith(close, end) else None


class DeepseekReplyParser:
    """One choice's parser; feed it the choice's whole text each time it grows."""

    def __init__(self, dialect: Dialect, thinking: bool, tools: bool) -> None:
        self.dialect = dialect
        self.thinking = thinking
        self.tools = tools
        self._calls: list[ToolCall] = []  # kept across calls so ids stay the same
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_names = 0
        self._sent_arguments = 0
        self.last: ParsedReply | None = None  # what the last ``delta`` read

    # ---- reading --------------------------------------------------------------------------

    def _calls_in(self, block: str, finished: bool) -> tuple[list[tuple[str, dict, bool]], bool, int | None]:
        """The invokes of a tool-call block (name, arguments, complete); whether it is DSML
        (if not, nothing is a call); where the block's closing tag ends (None: not yet)."""
        d = self.dialect
        found: list[tuple[str, dict, bool]] = []
        pos = 0
        while True:
            while pos < len(block) and block[pos].isspace():
                pos += 1
            rest = block[pos:]
            if rest.startswith(d.calls_close):
                return found, True, pos + len(d.calls_close)
            if not rest:
                return found, True, None
            if not rest.startswith(d.invoke_open):  # the next tag still arriving, or not DSML
                partial = any(m.startswith(rest) for m in (d.calls_close, d.invoke_open))
                return found, bool(found) or (partial and not finished), None
            name = _NAME.match(rest, len(d.invoke_open))
            if name is None:  # the name still arriving, or not DSML
                return found, bool(found) or not finished, None
            args: dict[str, Any] = {}
            at = name.end()
            while True:
                while at < len(rest) and rest[at].isspace():
                    at += 1
                if rest.startswith(d.invoke_close, at):
                    found.append((name.group(1), args, True))
                    pos += at + len(d.invoke_close)
                    break
                param = (
                    _PARAM.match(rest, at + len(d.parameter_open))
                    if rest.startswith(d.parameter_open, at)
                    else None
                )
                json_value = None
                if param is not None and param.group(2) == "false":
                    json_value = _json_then(rest, param.end(), d.parameter_close)
                    if json_value is None and not finished:  # JSON still arriving: its strings
                        found.append((name.group(1), args, False))  # may hold the closing tag
                        return found, True, None
                if json_value is not None:
                    args[param.group(1)], at = json_value
                    continue
                end = rest.find(d.parameter_close, param.end()) if param else -1
                if end < 0:  # an argument still arriving (or cut off)
                    found.append((name.group(1), args, False))
                    return found, True, None
                args[param.group(1)] = _value(rest[param.end() : end], param.group(2) == "true")
                at = end + len(d.parameter_close)

    def parse(self, text: str, finished: bool) -> ParsedReply:
        """What ``text`` says so far; with ``finished`` False only the parts that are settled."""
        d = self.dialect
        reasoning, rest = "", text
        if self.thinking:  # reasoning ends at </think> only (a quoted block in it is reasoning)
            end = text.find(END_THINK)
            if end < 0:
                return ParsedReply(text if finished else _held(text, [END_THINK], False), "", [])
            reasoning, rest = text[:end], text[end + len(END_THINK) :]
        if not self.tools:
            return ParsedReply(reasoning, rest, [])
        parts: list[str] = []
        calls: list[tuple[str, dict, bool]] = []
        pos = 0
        while True:
            at = rest.find(d.calls_open, pos)
            segment = rest[pos:] if at < 0 else rest[pos:at]
            if calls:  # text after a block: its separating whitespace is not content
                segment = segment.lstrip()
            if at < 0:
                parts.append(segment if finished else _held(segment, [d.calls_open], True))
                break
            parts.append(segment[:-2] if segment.endswith("\n\n") else segment)
            found, valid, end = self._calls_in(rest[at + len(d.calls_open) :], finished)
            if not valid:  # not DSML: from here on it is text (held back until the end)
                raw = rest[pos:at].lstrip() if calls else rest[pos:at]
                parts[-1] = raw + rest[at:] if finished else raw.rstrip()
                break
            calls += found
            if end is None:  # the block is still open (or was cut off)
                break
            pos = at + len(d.calls_open) + end
        for j, (name, args, complete) in enumerate(calls):
            if j < len(self._calls):
                self._calls[j].arguments, self._calls[j].complete = args, complete
            else:
                self._calls.append(ToolCall(name, args, complete))
        return ParsedReply(reasoning, "".join(parts), self._calls[: len(calls)])

    # ---- streaming ------------------------------------------------------------------------

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The OpenAI ``delta`` fields new since the last call (empty dict: nothing new)."""
        reply = self.last = self.parse(text, finished)
        out: dict[str, Any] = {}
        if len(reply.reasoning) > self._sent_reasoning:
            out["reasoning_content"] = reply.reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reply.reasoning)
        if len(reply.content) > self._sent_content:
            out["content"] = reply.content[self._sent_content :]
            self._sent_content = len(reply.content)
        calls = []
        for j, call in enumerate(reply.tool_calls):
            if j >= self._sent_names:
                calls.append(
                    {
                        "index": j,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                self._sent_names = j + 1
            if j >= self._sent_arguments and (call.complete or finished):
                args = {"index": j, "function": {"arguments": call.arguments_json()}}
                if calls and calls[-1]["index"] == j:
                    calls[-1]["function"]["arguments"] = args["function"]["arguments"]
                else:
                    calls.append(args)
                self._sent_arguments = j + 1
        if calls:
            out["tool_calls"] = calls
        return out
