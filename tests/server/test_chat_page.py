"""The chat page of ``deepinfer serve``, driven in a real browser: Debian's Chromium under
Playwright (``executable_path``: no browser download). A tiny V4 checkpoint with the real V4
tokenizer is served; its sampler is scripted to write a reply with reasoning, text and a DSML
tool call, one token every few milliseconds so that the stream is seen arriving, or, asked
for a long story, to write without end until stopped.

Checks: a typed message gets its reply streamed into the page, the reasoning folded and the
tool call shown; Stop ends the request on the server; an error or a reply cut off by New chat
is never sent back to the model; ``--no-ui`` leaves the page out.

Chromium is a Debian package (``apt-get install chromium``), not a Python one: without it these
tests are skipped, unless ``DEEPINFER_BROWSER_TESTS=required`` (set by ``.ci/run``, which
installs it) makes its absence a failure. ``DEEPINFER_DOCS_SCREENSHOT=PATH`` also saves the
screenshot of the first test there (how the docs' picture is made).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer
from scripted_sampling import scripted_sampler
from starlette.testclient import TestClient
from tiny_v4_chat import WEATHER_TOOLS as TOOLS
from tiny_v4_chat import tiny_v4_checkpoint

from deepinfer import LLM
from deepinfer.chat.deepseek import EOS, V4, encode_deepseek
from deepinfer.cli.parser import build_parser
from deepinfer.server.app import build_app

NAME = "tiny-v4"
STEP_S = 0.03  # the scripted model's time per token
CHROMIUM = os.environ.get("DEEPINFER_CHROMIUM", "/usr/bin/chromium")
# flags for a sandboxed machine with no network (as the machine notes advise for Chromium)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ASK = "What is the weather in Paris for 3 days?"
CONTENT = "Let me look that up."
REASONING = "The user wants a forecast, so I call the weather tool."
LONG_ASK = "Tell me a long story."


def _reply_text() -> str:
    """The reply the scripted model writes: the format's own rendering of an assistant turn."""
    ask = [{"role": "user", "content": ASK}]
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
    }
    turn = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING, "tool_calls": [call]}
    tools = [t["function"] for t in TOOLS]
    pre = encode_deepseek(ask, V4, tools=tools).render()
    return encode_deepseek([*ask, turn], V4, tools=tools).render()[len(pre) : -len(EOS)]


class ScriptedModel:
    """The sampler's stand-in: the reply script for the weather question, an endless story
    for the long one; counts the tokens it writes."""

    def __init__(self, tokenizer, eos: int) -> None:
        self.tokenizer = tokenizer
        self.reply = tokenizer(_reply_text(), add_special_tokens=False).input_ids + [eos]
        self.story = tokenizer("Thinking.</think>Once upon a time", add_special_tokens=False).input_ids
        self.filler = tokenizer(" and then", add_special_tokens=False).input_ids
        self.tokens = 0

    def __call__(self, logits, rows, **options) -> list[int]:
        time.sleep(STEP_S)
        out = []
        for row in rows:
            # decided from the prompt at every step: a cache keyed by id() of the prompt list
            # would give a later request a freed request's answer when Python reuses the id
            n = len(row.output_ids)
            if LONG_ASK in self.tokenizer.decode(row.prompt_ids[-40:]):
                extra = n - len(self.story)
                out.append(self.story[n] if extra < 0 else self.filler[extra % len(self.filler)])
            else:
                out.append(self.reply[min(n, len(self.reply) - 1)])
            self.tokens += 1
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_page"))
    llm = LLM(str(path), max_num_seqs=4, max_model_len=4096)
    model = ScriptedModel(llm.tokenizer, llm.eos_token_ids[0])
    with scripted_sampler(model):
        live = LiveServer(build_app(llm, NAME, max_queued_requests=16))
        yield live, llm, model
        live.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        message = (
            f"no Chromium at {CHROMIUM} (apt-get install chromium, or DEEPINFER_CHROMIUM=PATH); "
            "skipped unless DEEPINFER_BROWSER_TESTS=required, which CI sets and the README's command does not"
        )
        if os.environ.get("DEEPINFER_BROWSER_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(served, browser):
    live, _, _ = served
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(live.url + "/")
    page.wait_for_function(f"document.querySelector('#model').value === {json.dumps(NAME)}")
    yield page
    context.close()


def _running(live) -> float:
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    found = re.search(r"^deepinfer:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, text[:2000]
    return float(found.group(1))


def test_a_message_streams_its_reply_with_reasoning_folded_and_the_tool_call_shown(page, tmp_path):
    page.click("#toggle-settings")
    page.fill("#tools", json.dumps(TOOLS))
    page.fill("#max_tokens", "400")
    page.click("#toggle-settings")
    page.fill("#prompt", ASK)
    page.press("#prompt", "Enter")
    reply = ".message.assistant"
    # seen while it streams: some reasoning on the page, the Stop button live
    page.wait_for_function(
        "document.querySelector('.message.assistant details.reasoning pre')?.textContent.length > 0"
        " && !document.querySelector('#stop').disabled"
    )
    page.wait_for_function("document.querySelector('#stop').disabled")  # the reply ended
    assert page.text_content(f"{reply} .content") == CONTENT
    details = page.locator(f"{reply} details.reasoning")
    assert details.get_attribute("open") is None  # folded
    assert details.locator("summary").is_visible() and not details.locator("pre").is_visible()
    assert details.locator("pre").text_content() == REASONING
    details.locator("summary").click()  # a reader can unfold it
    assert details.locator("pre").is_visible()
    details.locator("summary").click()
    call = page.text_content(f"{reply} .tool-call")
    assert call.startswith("tool call: get_weather(") and json.loads(
        call[len("tool call: get_weather(") : -1]
    ) == {
        "city": "Paris",
        "days": 3,
    }
    stats = page.text_content(f"{reply} .stats")
    assert re.search(r"\d+ tokens · [0-9.]+ tokens/s", stats) and "finish: tool_calls" in stats, stats
    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DEEPINFER_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["DEEPINFER_DOCS_SCREENSHOT"])


def test_stop_ends_the_request_on_the_server(page, served):
    live, _, model = served
    page.click("#toggle-settings")
    page.fill("#max_tokens", "3000")  # about 90 s of story at the scripted pace
    page.click("#toggle-settings")
    page.fill("#prompt", LONG_ASK)
    page.click("#send")
    page.wait_for_function(
        "document.querySelector('.message.assistant .content').textContent.includes('Once upon a time and then')"
    )
    assert _running(live) == 1
    page.click("#stop")
    deadline = time.time() + 10
    while _running(live) != 0:
        assert time.time() < deadline, "the stopped request still runs on the server"
        time.sleep(0.1)
    written = model.tokens
    time.sleep(10 * STEP_S)
    assert model.tokens == written  # the engine writes no more tokens for it
    assert "stopped" in page.text_content(".message.assistant .stats")
    assert not page.is_disabled("#send")


def _sent_messages(page, text: str) -> list[dict]:
    """Send ``text`` from the page and return the messages of the request it makes."""
    page.fill("#prompt", text)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        page.click("#send")
    return json.loads(request.value.post_data)["messages"]


def test_errors_and_a_new_chat_are_not_sent_back_to_the_model(page):
    """An error is shown but never resent as the model's words (its turn is dropped); a reply
    stopped by New chat does not join the new conversation."""
    page.click("#toggle-settings")
    page.fill("#tools", json.dumps([{"type": "function", "function": {"name": 'say"hi'}}]))
    page.select_option("#tool_choice", "required")  # a forced call to a name DSML cannot write: a 400
    page.click("#toggle-settings")
    _sent_messages(page, "first")
    page.wait_for_function(
        "document.querySelector('.message.assistant .stats').textContent.includes('error')"
    )
    assert "cannot be written in a DSML call" in page.text_content(".message.assistant .error")
    page.click("#toggle-settings")
    page.fill("#tools", "")
    page.click("#toggle-settings")
    assert _sent_messages(page, LONG_ASK) == [{"role": "user", "content": LONG_ASK}]
    page.wait_for_function(
        "document.querySelector('#messages').textContent.includes('Once upon a time and then')"
    )
    page.click("#new-chat")
    page.wait_for_function("!document.querySelector('#send').disabled")  # the stopped reply has ended
    assert _sent_messages(page, "again") == [{"role": "user", "content": "again"}]
    page.wait_for_function("document.querySelector('#stop').disabled")


def test_the_page_is_served_unless_turned_off(served):
    _, llm, _ = served
    with_ui = TestClient(build_app(llm, NAME))  # no lifespan: no engine loop is started
    page = with_ui.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/chat.js">' in page.text
    assert with_ui.get("/ui/chat.js").status_code == 200
    without = TestClient(build_app(llm, NAME, ui=False))
    assert without.get("/").status_code == 404 and without.get("/ui/chat.js").status_code == 404
    assert build_parser().parse_args(["serve", "m", "--no-ui"]).no_ui
    assert not build_parser().parse_args(["serve", "m"]).no_ui
