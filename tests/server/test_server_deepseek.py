"""``deepinfer serve`` speaking DeepSeek-V4's chat format to the official ``openai`` client: a
tiny V4 checkpoint with the real V4 tokenizer, whose sampler is scripted to write a reply with
reasoning and DSML tool calls (random weights would never write one). Checks that the prompt
is the format's encoding, that the reply comes back as ``reasoning_content``, ``content`` and
``tool_calls`` streamed or not, with no markup in the streamed content, and that a tool-result
turn is accepted."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from live_server import LiveServer
from scripted_sampling import scripted_sampler
from tiny_v4_chat import WEATHER_TOOLS as TOOLS
from tiny_v4_chat import tiny_v4_checkpoint

import deepinfer.engine.step_processor as engine_module
from deepinfer import LLM
from deepinfer.chat import ChatOptions
from deepinfer.chat.deepseek import DSML, EOS, V4, encode_deepseek
from deepinfer.server.app import build_app

NAME = "tiny-v4"
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = {
    "id": "x",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
}


def _scripted_reply() -> str:
    """The reply the scripted model writes: the format's own rendering of an assistant turn."""
    turn = {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "I need the forecast.",
        "tool_calls": [CALL],
    }
    tools = [t["function"] for t in TOOLS]
    pre = encode_deepseek(ASK, V4, tools=tools).render()
    full = encode_deepseek([*ASK, turn], V4, tools=tools).render()
    return full[len(pre) : -len(EOS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_chat"))
    llm = LLM(str(path), max_num_seqs=4, max_model_len=2048)
    script = llm.tokenizer(_scripted_reply(), add_special_tokens=False).input_ids + [llm.eos_token_ids[0]]
    real_sample = engine_module.sample

    def scripted(logits, rows, **options):  # the n-th output token of every request is the script's n-th
        real_sample(logits, rows, **options)
        return [script[min(len(r.output_ids), len(script) - 1)] for r in rows]

    with scripted_sampler(scripted):
        live = LiveServer(build_app(llm, NAME, max_queued_requests=16))
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=300)
        yield live, client, llm
        live.stop()


def test_prompt_is_the_formats_encoding(served):
    live, client, llm = served
    resp = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=1)
    want = llm.chat_format.encode(ASK, TOOLS, True, ChatOptions())
    assert resp.usage.prompt_tokens == len(want)
    r = httpx.post(f"{live.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60)
    assert r.json()["tokens"] == want
    no_think = httpx.post(
        f"{live.url}/tokenize",
        json={"messages": ASK, "chat_template_kwargs": {"thinking": False}},
        timeout=60,
    ).json()["tokens"]
    assert llm.tokenizer.decode(no_think).endswith("<｜Assistant｜></think>")


def test_reply_becomes_reasoning_content_and_tool_calls(served):
    _, client, _ = served
    resp = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "I need the forecast."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 3,
    }
    assert call.id.startswith("call_")


def test_streamed_reply_assembles_the_same_and_never_leaks_markup(served):
    _, client, _ = served
    stream = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, max_tokens=200, stream=True
    )
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert DSML not in (delta.content or "") and "</" not in (delta.content or "")
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = part.id or entry["id"]
            entry["name"] += (part.function.name or "") if part.function else ""
            entry["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == ("Checking.", "I need the forecast.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_tool_results_turn_and_tool_choice_none(served):
    live, client, llm = served
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "x", "content": "sunny, 21C"},
    ]
    resp = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=1)
    ids = llm.chat_format.encode(history, TOOLS, True, ChatOptions())
    assert resp.usage.prompt_tokens == len(ids)
    assert "<tool_result>sunny, 21C</tool_result>" in llm.tokenizer.decode(ids)
    # tool_choice="none": no tools in the prompt and the reply is not parsed for calls
    resp = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "stop"
    r = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "any"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    bad = [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": NAME, "messages": bad}, timeout=60)
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    )
    r = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": NAME, "messages": ASK, "reasoning_effort": "huge"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
