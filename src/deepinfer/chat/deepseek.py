"""DeepSeek-V4 and V4.1 chat prompts: system/user/assistant turns, thinking on or off, tools
and tool calls in DSML markup, tool results.

The checkpoints ship no Jinja template; the format is the one DeepSeek publishes with the
models (``encoding/encoding_dsv4.py``, and V4.1's, which SGLang carries as
``encoding_dsv41.py``; vLLM's ``deepseek_v4`` tokenizer mode applies it). Written here from that
description:

- ``<｜begin▁of▁sentence｜>``, then each message. A system message is its text (V4.1 opens it
  with ``<｜System｜>``), followed by the tool schemas when the request has tools. A user turn
  is ``<｜User｜>`` + text; OpenAI ``tool`` messages become ``<tool_result>...</tool_result>``
  blocks of a user turn (in the order of the calls they answer), joined by blank lines; a
  developer message is a user turn of its own (dropped with the old reasoning, as below).
- After a user turn that the assistant answers: ``<｜Assistant｜>`` and ``<think>`` (thinking)
  or ``</think>`` (chat, and every earlier turn while older reasoning is dropped).
- An assistant turn: its reasoning and ``</think>`` when kept, its text, then its tool calls
  as ``\\n\\n<｜DSML｜tool_calls>`` ... ``</｜DSML｜tool_calls>`` with one ``invoke`` per call
  and one ``parameter`` per argument (strings as they are with ``string="true"``, other
  values as JSON), then ``<｜end▁of▁sentence｜>``. V4.1 names the tags `` calls``,
  `` invoke``, `` parameter`` (a leading space).
- Reasoning of turns before the last user turn is dropped, unless the request has tools.
- Reasoning effort: V4 writes a fixed paragraph before everything for ``max``; V4.1 a
  ``Reasoning Effort: N`` line (1-100; low/high/xhigh/max = 25/50/75/100, default high), in
  thinking mode only.

Control tokens are added as control pieces and every text (users' and the template's prose) as
plain text (``plain.Prompt``), so no message can open or close a turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepinfer.chat.messages import normalize_messages
from deepinfer.chat.plain import Prompt

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
CONTROL_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM, THINK, END_THINK, DSML)

# The format's fixed texts (the models were trained on them, so they are reproduced exactly).
_V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
_V41_EFFORT = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
_V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D}{calls}>" block like the following:

<{D}{calls}>
<{D}{invoke} name="$TOOL_NAME">
<{D}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}{param}>
...
</{D}{invoke}>
<{D}{invoke} name="$TOOL_NAME2">
...
</{D}{invoke}>
</{D}{calls}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


@dataclass(frozen=True)
class Dialect:
    """What differs between V4 and V4.1."""

    name: str
    calls_tag: str
    invoke_tag: str
    parameter_tag: str
    system_token: bool  # V4.1: system messages open with <｜System｜>; a later one acts as a user turn

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls_tag}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.calls_tag}>"

    @property
    def invoke_open(self) -> str:
        return f"<{DSML}{self.invoke_tag}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke_tag}>"

    @property
    def parameter_open(self) -> str:
        return f"<{DSML}{self.parameter_tag}"

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter_tag}>"


V4 = Dialect("deepseek_v4", "tool_calls", "invoke", "parameter", system_token=False)
V41 = Dialect("deepseek_v41", " calls", " invoke", " parameter", system_token=True)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _markup(prompt: Prompt, text: str) -> None:
    """The format's own text, with its control strings as control pieces (never for users' text)."""
    while text:
        found = [(text.find(t), t) for t in CONTROL_TOKENS if t in text]
        if not found:
            prompt.text(text)
            return
        pos, token = min(found)
        prompt.text(text[:pos])
        prompt.control(token)
        text = text[pos + len(token) :]


def _tools_section(prompt: Prompt, dialect: Dialect, tools: list[dict[str, Any]]) -> None:
    """The tool instructions with each schema as one JSON line (the schemas are the caller's
    text: plain pieces, never markup)."""
    head, tail = _TOOLS.split("{schemas}")
    fill = {
        "D": DSML,
        "calls": dialect.calls_tag,
        "invoke": dialect.invoke_tag,
        "param": dialect.parameter_tag,
        "think": THINK,
        "end_think": END_THINK,
    }
    _markup(prompt, head.format(**fill))
    prompt.text("\n".join(_json(fn) for fn in tools))
    _markup(prompt, tail)


def _tool_calls(prompt: Prompt, dialect: Dialect, calls: list[dict[str, Any]]) -> None:
    prompt.text("\n\n<")
    prompt.control(DSML)
    prompt.text(f"{dialect.calls_tag}>\n")
    for j, call in enumerate(calls):
        if j:
            prompt.text("\n")
        prompt.text("<")
        prompt.control(DSML)
        prompt.text(f'{dialect.invoke_tag} name="{call["name"]}">\n')
        for k, (key, value) in enumerate(call["arguments"].items()):
            if k:
                prompt.text("\n")
            is_str = isinstance(value, str)
            prompt.text("<")
            prompt.control(DSML)
            prompt.text(f'{dialect.parameter_tag} name="{key}" string="{"true" if is_str else "false"}">')
            prompt.text(value if is_str else _json(value))
            prompt.text("</")
            prompt.control(DSML)
            prompt.text(f"{dialect.parameter_tag}>")
        prompt.text("\n</")
        prompt.control(DSML)
        prompt.text(f"{dialect.invoke_tag}>")
    prompt.text("\n</")
    prompt.control(DSML)
    prompt.text(f"{dialect.calls_tag}>")


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user and OpenAI ``tool`` messages joined into one user turn made of blocks
    (tool results as ``<tool_result>`` blocks), the results ordered as the calls of the
    assistant turn before them."""
    merged: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            order = {c["id"]: j for j, c in enumerate(m["tool_calls"]) if c["id"]}
        if role not in ("user", "tool"):
            merged.append(m)
            continue
        block = ("tool" if role == "tool" else "text", m.get("tool_call_id") or "", m["content"])
        if merged and merged[-1]["role"] == "user":
            merged[-1]["blocks"].append(block)
        else:
            merged.append({"role": "user", "blocks": [block], "order": order})
    for m in merged:
        if m["role"] == "user":
            results = sorted(
                (b for b in m["blocks"] if b[0] == "tool"), key=lambda b: m["order"].get(b[1], 0)
            )
            it = iter(results)
            m["blocks"] = [next(it) if b[0] == "tool" else b for b in m["blocks"]]
    return merged


def _effort(dialect: Dialect, effort: str | int | None) -> str:
    """The effort text that opens a thinking-mode prompt ("" for none)."""
    if dialect is V4:
        if effort not in (None, "minimal", "low", "medium", "high", "max"):
            raise ValueError(f"reasoning_effort: {effort!r} is not one of minimal, low, medium, high, max")
        return _V4_MAX_EFFORT if effort == "max" else ""
    if effort is not None and (not isinstance(effort, str | int) or isinstance(effort, bool)):
        raise ValueError(
            f"reasoning_effort: {effort!r} is not an integer in 1..100 or one of {list(_V41_EFFORTS)}"
        )
    effort = {None: "high", "minimal": "low", "medium": "high"}.get(effort, effort)  # type: ignore[arg-type]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        budget = effort
    elif isinstance(effort, str) and effort in _V41_EFFORTS:
        budget = _V41_EFFORTS[effort]
    else:
        raise ValueError(
            f"reasoning_effort: {effort!r} is not an integer in 1..100 or one of {list(_V41_EFFORTS)}"
        )
    return _V41_EFFORT.format(budget=budget)


def encode_deepseek(
    messages: list[Any],
    dialect: Dialect,
    *,
    thinking: bool = True,
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | int | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
) -> Prompt:
    """The prompt for ``messages`` (OpenAI shape) in ``dialect``'s format (module docstring)."""
    msgs = normalize_messages(messages, joiner="\n\n")
    for i, m in enumerate(msgs):
        if m["role"] == "developer" and not m["content"]:
            raise ValueError(f"messages[{i}].content: a developer message needs text")
    if reasoning_effort == "none":
        thinking, reasoning_effort = False, None
    effort = _effort(dialect, reasoning_effort) if thinking else ""
    if tools:
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "tools": tools}
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    msgs = _merge_tool_results(msgs)
    drop = drop_thinking and not tools

    def opens_answer(i: int) -> bool:  # a turn the assistant answers after
        role = msgs[i]["role"]
        return role in ("user", "developer") or (dialect.system_token and role == "system" and i > 0)

    last_user = max((i for i in range(len(msgs)) if opens_answer(i)), default=-1)
    if thinking and drop:  # developer turns before the last user turn go with the old reasoning
        msgs = [m for i, m in enumerate(msgs) if m["role"] != "developer" or i >= last_user]
        last_user = max((i for i in range(len(msgs)) if opens_answer(i)), default=-1)
    prompt = Prompt()
    prompt.control(BOS)
    for i, m in enumerate(msgs):
        role = m["role"]
        if i == 0 and dialect.system_token and (effort or role == "system"):
            prompt.control(SYSTEM)
        if i == 0:
            prompt.text(effort)
        if role == "system":
            if i > 0 and dialect.system_token:
                prompt.control(SYSTEM)
            prompt.text(m["content"])
            if m.get("tools"):
                prompt.text("\n\n")
                _tools_section(prompt, dialect, m["tools"])
        elif role == "developer":  # a user turn carrying instructions
            prompt.control(USER)
            prompt.text(m["content"])
        elif role == "user":
            prompt.control(USER)
            for j, (kind, _, text) in enumerate(m["blocks"]):
                if j:
                    prompt.text("\n\n")
                prompt.text(f"<tool_result>{text}</tool_result>" if kind == "tool" else text)
        else:  # assistant
            if thinking and (not drop or i > last_user):
                prompt.text(m.get("reasoning_content") or "")
                prompt.control(END_THINK)
            prompt.text(m["content"])
            if m.get("tool_calls"):
                _tool_calls(prompt, dialect, m["tool_calls"])
            prompt.control(EOS)
        last = i + 1 == len(msgs)
        if not opens_answer(i) or (not last and msgs[i + 1]["role"] != "assistant"):
            continue
        if last and not add_generation_prompt:
            continue
        prompt.control(ASSISTANT)
        prompt.control(THINK if thinking and (not drop or i >= last_user) else END_THINK)
    return prompt
