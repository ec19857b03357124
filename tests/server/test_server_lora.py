"""Multi-LoRA serving over HTTP, on a tiny Llama and PEFT adapters made for it: a request's
``model`` naming an adapter runs with it (greedy outputs equal ``LLM.generate`` /
``LLM.chat`` with that ``LoRARequest``, and differ from the base model's), adapters load and
unload while serving (``/v1/models`` follows; an unloaded name is a 404; a request queued
before the unload finishes with its adapter), a bad load is a 400 naming the problem and
changes nothing, the adapter metrics, the API key on the control routes, a server without
``--enable-lora``, and ``deepinfer serve --enable-lora --lora-modules``."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer, ServeProcess

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.cli import main
from deepinfer.server.app import build_app
from deepinfer.server.lora_modules import LoraModule, parse_lora_module
from deepinfer.tiny import make_tiny_checkpoint, tiny_config

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny"
PROMPT = [5, 9, 17, 33, 2, 8, 40, 41]
CHAT = [{"role": "user", "content": "hello there"}]
MAX_RANK = 4
ENGINE = {"enable_lora": True, "max_lora_rank": MAX_RANK, "max_loras": 2}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# a template, so that chat requests render on the tiny tokenizer
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _make_adapter(base: torch.nn.Module, out: Path, targets: list[str], rank: int, seed: int) -> str:
    """A PEFT adapter with random A and B (B scaled down, so outputs move but stay sane)."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.3)
    model.save_pretrained(out)
    model.unload()  # the base model back without adapter layers, for the next adapter
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The checkpoint and its adapters: two good ones, one of too high a rank, one made for a
    model of another size."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("lora")
    ckpt = make_tiny_checkpoint(root / "ckpt", arch="llama", seed=0)
    tokenizer_config = ckpt / "tokenizer_config.json"
    tokenizer_config.write_text(
        json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": TEMPLATE})
    )
    base = AutoModelForCausalLM.from_pretrained(ckpt)
    other = AutoModelForCausalLM.from_config(
        LlamaConfig.from_dict(tiny_config("llama", intermediate_size=96))
    )
    return {
        "ckpt": str(ckpt),
        "a1": _make_adapter(base, root / "a1", ["q_proj", "v_proj", "down_proj"], 4, seed=1),
        "a2": _make_adapter(base, root / "a2", ["k_proj", "o_proj", "gate_proj", "up_proj"], 2, seed=2),
        "rank8": _make_adapter(base, root / "rank8", ["q_proj"], 8, seed=3),
        "other": _make_adapter(other, root / "other", ["down_proj"], 4, seed=4),
    }


@pytest.fixture(scope="module")
def expected(files) -> dict[str, str]:
    """What ``LLM`` generates offline with each adapter, and without one."""
    llm = LLM(files["ckpt"], **ENGINE)
    a1, a2 = LoRARequest("a1", 1, files["a1"]), LoRARequest("a2", 2, files["a2"])
    texts = {
        key: llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        for key, lora in (("base", None), ("a1", a1), ("a2", a2))
    }
    texts["chat_a1"] = llm.chat(CHAT, GREEDY, use_tqdm=False, lora_request=a1)[0].outputs[0].text
    texts["chat_base"] = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert texts["a1"] != texts["base"] and texts["a2"] != texts["base"] and texts["a1"] != texts["a2"]
    return texts


@pytest.fixture(scope="module")
def served(files, expected):
    """One server for the module, serving ``a1`` from the start."""
    app = build_app(
        LLM(files["ckpt"], **ENGINE),
        NAME,
        api_key=KEY,
        lora_modules=[LoraModule("a1", files["a1"])],
        enable_rl_endpoints=True,
        allow_runtime_lora_updating=True,
    )
    live = LiveServer(app)
    client = httpx.Client(base_url=live.url, headers=AUTH, timeout=60)
    yield client
    live.stop()


def _complete(client: httpx.Client, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return client.post("/v1/completions", json=body)


def _text(client: httpx.Client, model: str | None) -> str:
    resp = _complete(client, model)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == (model or NAME)
    return resp.json()["choices"][0]["text"]


def _models(client: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in client.get("/v1/models").json()["data"]}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _load(client: httpx.Client, name: str, path: str) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _unload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_lora_modules_parse_both_spellings():
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    spelled = '{"name": "sql", "path": "/a/b", "base_model_name": "llama"}'
    assert parse_lora_module(spelled) == LoraModule("sql", "/a/b", "llama")
    for bad, why in [
        ("sql", "name=path"),
        ('{"name": "sql"}', "'path'"),
        ('{"name": 1, "path": "/a"}', "'name'"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="unknown key"):
        parse_lora_module('{"name": "sql", "path": "/a", "rank": 8}')


def test_a_model_naming_an_adapter_runs_with_it(served, expected):
    assert _text(served, "a1") == expected["a1"]
    assert _text(served, NAME) == _text(served, None) == expected["base"]
    streamed = _complete(served, "a1", stream=True)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert {e["model"] for e in events} == {"a1"}
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected["a1"]
    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    for model, key in (("a1", "chat_a1"), (NAME, "chat_base")):
        resp = served.post("/v1/chat/completions", json={**chat, "model": model})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected[key]
        assert resp.json()["model"] == model


def test_an_unknown_model_is_a_404(served):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        error = _error(served.post(path, json={**body, "model": "nope"}), 404)
        assert error == {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }


def test_v1_models_lists_the_base_model_then_its_adapters(served, files):
    cards = served.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [NAME, "a1"]
    assert cards[0]["parent"] is None and cards[0]["root"] == files["ckpt"]
    assert cards[1]["object"] == "model" and cards[1]["root"] == files["a1"] and cards[1]["parent"] == NAME


def test_an_adapter_loaded_while_serving_is_used_then_unloaded(served, files, expected):
    resp = _load(served, "a2", files["a2"])
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert "a2" in resp.text and resp.text.startswith("Success")
    assert _models(served)["a2"]["root"] == files["a2"]
    assert _text(served, "a2") == expected["a2"]
    assert _text(served, "a1") == expected["a1"]  # the others unchanged
    resp = _unload(served, "a2")
    assert resp.status_code == 200 and resp.text.startswith("Success")
    assert "a2" not in _models(served)
    assert _error(_complete(served, "a2"), 404)["message"] == "The model `a2` does not exist."
    error = _error(_unload(served, "a2"), 404)
    assert error["param"] == "lora_name" and "'a2' is not loaded" in error["message"]


def test_a_bad_load_is_a_400_and_changes_nothing(served, files, expected, tmp_path):
    before = _models(served)
    cases = [
        ("gone", str(tmp_path / "missing"), "lora_path", "is not a directory"),
        ("empty", str(tmp_path), "lora_path", "no adapter_config.json"),
        ("big", files["rank8"], "lora_path", f"rank 8 at .* is above max_lora_rank={MAX_RANK}"),
        ("other", files["other"], "lora_path", "base-model mismatch at 'model.layers.0.mlp.down_proj'"),
        ("a1", files["a2"], "lora_name", "'a1' is loaded already"),
        (NAME, files["a2"], "lora_name", "the served model's own name"),
        ("", files["a2"], "lora_name", "non-empty"),
    ]
    for name, path, param, why in cases:
        error = _error(_load(served, name, path), 400)
        assert error["param"] == param and re.search(why, error["message"]), (name, error)
    error = _error(served.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
    assert error["param"] == "lora_path"
    assert _models(served).keys() == before.keys()
    assert _text(served, "a1") == expected["a1"] and _text(served, None) == expected["base"]
    assert _error(_complete(served, "big"), 404)["param"] == "model"


def _metric_lines(client: httpx.Client) -> list[str]:
    text = client.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith("deepinfer:lora")]


def _paused(client: httpx.Client, model: str, results: list) -> threading.Thread:
    """Pause the engine and queue a completion with ``model``; the caller continues."""
    assert client.post("/pause_generation", json={}).status_code == 200
    worker = threading.Thread(target=lambda: results.append(_text(client, model)))
    worker.start()
    return worker


def _wait_for(predicate, what: str) -> None:
    deadline = time.time() + 30
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_metrics_count_loaded_and_queued_adapters(served, files, expected):
    assert f'deepinfer:lora_adapters_loaded{{model_name="{NAME}"}} 1.0' in _metric_lines(served)
    assert _load(served, "a2", files["a2"]).status_code == 200
    results: list = []
    worker = _paused(served, "a2", results)
    try:
        _wait_for(lambda: any('waiting_lora_adapters="a2"' in m for m in _metric_lines(served)), "queued")
        lines = _metric_lines(served)
        assert f'deepinfer:lora_adapters_loaded{{model_name="{NAME}"}} 2.0' in lines
        assert f'deepinfer:lora_adapters_running{{model_name="{NAME}"}} 0.0' in lines
        (info,) = [m for m in lines if m.startswith("deepinfer:lora_requests_info{")]
        assert 'max_lora="2"' in info and 'running_lora_adapters=""' in info
    finally:
        served.post("/continue_generation", json={})
        worker.join(timeout=60)
    assert results == [expected["a2"]]
    assert _unload(served, "a2").status_code == 200
    assert f'deepinfer:lora_adapters_loaded{{model_name="{NAME}"}} 1.0' in _metric_lines(served)


def test_a_request_queued_before_an_unload_finishes_with_its_adapter(served, files, expected):
    assert _load(served, "a2", files["a2"]).status_code == 200
    results: list = []
    worker = _paused(served, "a2", results)
    try:
        _wait_for(lambda: any('waiting_lora_adapters="a2"' in m for m in _metric_lines(served)), "queued")
        assert _unload(served, "a2").status_code == 200  # between steps, while paused
    finally:
        served.post("/continue_generation", json={})
        worker.join(timeout=60)
    assert results == [expected["a2"]]
    assert "a2" not in _models(served)


def test_the_adapter_routes_take_the_key(served, files):
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": files["a2"]}),
        ("/v1/unload_lora_adapter", {"lora_name": "a1"}),
    ):
        assert httpx.post(str(served.base_url) + path, json=body, timeout=30).status_code == 401
    assert "a1" in _models(served) and "a2" not in _models(served)


def test_a_server_without_enable_lora_refuses_adapters(files):
    live = LiveServer(build_app(LLM(files["ckpt"]), NAME, allow_runtime_lora_updating=True))
    try:
        client = httpx.Client(base_url=live.url, timeout=60)
        for resp in (_load(client, "a1", files["a1"]), _unload(client, "a1")):
            assert "LoRA is not enabled" in _error(resp, 400)["message"]
        assert _error(_complete(client, "a1"), 404)["param"] == "model"
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [NAME]
        assert "lora" not in client.get("/metrics").text
    finally:
        live.stop()
    with pytest.raises(ValueError, match="--lora-modules a1=.*LoRA is not enabled"):
        build_app(LLM(files["ckpt"]), NAME, lora_modules=[LoraModule("a1", files["a1"])])


def test_serve_loads_lora_modules_at_start(files, expected):
    a2 = json.dumps({"name": "a2", "path": files["a2"], "base_model_name": "tiny-llama"})
    args = ["--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2"]
    proc = ServeProcess(
        files["ckpt"], *args, "--served-model-name", NAME, "--lora-modules", f"a1={files['a1']}", a2
    )
    try:
        client = httpx.Client(base_url=proc.url, timeout=60)
        cards = _models(client)
        assert list(cards) == [NAME, "a1", "a2"] and cards["a2"]["parent"] == "tiny-llama"
        assert _text(client, "a1") == expected["a1"] and _text(client, "a2") == expected["a2"]
    finally:
        assert proc.terminate() == 0


def test_serve_stops_at_a_bad_lora_module(files, monkeypatch, capsys):
    monkeypatch.setattr("deepinfer.compile.gc_heap.freeze_long_lived", lambda: None)  # this process goes on
    args = ["serve", files["ckpt"], "--enable-lora", "--max-lora-rank", str(MAX_RANK)]
    assert main([*args, "--lora-modules", f"big={files['rank8']}"]) == 2
    error = capsys.readouterr().err
    assert "--lora-modules big=" in error and f"above max_lora_rank={MAX_RANK}" in error
    assert main(["serve", files["ckpt"], "--lora-modules", f"a1={files['a1']}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
