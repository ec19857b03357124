"""The RL control endpoints of ``deepinfer serve --enable-rl-endpoints`` over HTTP: the API
key guards them, a weight update from disk lands between steps (completions then equal a
server of the new checkpoint's, and ``/get_weight_version`` moves on), a bad update answers
400 and changes nothing, a completion waits while generation is paused and finishes after
``/continue_generation``, and a sleeping engine answers 503 until it wakes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import LiveServer

from deepinfer import LLM
from deepinfer.server.app import build_app
from deepinfer.tiny import make_tiny_checkpoint

KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 9, 17, 33, 2, 8, 40, 41]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    old = make_tiny_checkpoint(tmp_path_factory.mktemp("old"), arch="llama", seed=3)
    new = make_tiny_checkpoint(tmp_path_factory.mktemp("new"), arch="llama", seed=4)
    live = LiveServer(build_app(LLM(old), "tiny", api_key=KEY, enable_rl_endpoints=True))
    # the control endpoints take only JSON, an empty body included
    client = httpx.Client(
        base_url=live.url, headers={**AUTH, "content-type": "application/json"}, timeout=120
    )
    reference = LiveServer(build_app(LLM(new), "tiny", api_key=KEY))  # serves the new weights
    expected = _complete(httpx.Client(base_url=reference.url, headers=AUTH, timeout=120))
    reference.stop()
    yield live, client, {"old": old, "new": new, "expected": expected}
    live.stop()


def _complete(client: httpx.Client) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def test_the_control_endpoints_take_the_key(served):
    live, _, _ = served
    for method, path in [("post", "/pause_generation"), ("get", "/get_weight_version"), ("post", "/sleep")]:
        resp = getattr(httpx, method)(live.url + path, timeout=30)
        assert resp.status_code == 401


def test_an_update_from_disk_lands_and_a_bad_one_changes_nothing(served):
    _, client, ckpts = served
    old, new = ckpts["old"], ckpts["new"]
    client.post("/update_weights_from_disk", json={"model_path": str(old)})  # a known start
    start = client.get("/get_weight_version").json()["weight_version"]
    before = _complete(client)
    resp = client.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert resp.status_code == 400 and "/no/such/dir" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "model_path"
    assert client.get("/get_weight_version").json()["weight_version"] == start
    assert _complete(client) == before
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(new), "weight_version": "policy-7"}
    )
    assert resp.status_code == 200 and resp.json() == {
        "success": True,
        "message": f"weights loaded from {new}",
        "weight_version": "policy-7",
    }
    assert client.get("/get_weight_version").json() == {"weight_version": "policy-7"}
    after = _complete(client)
    assert after == ckpts["expected"] and after != before  # a server of the new checkpoint's


def test_a_paused_engine_runs_no_step_until_continued(served):
    _, client, ckpts = served
    old, new = ckpts["old"], ckpts["new"]
    client.post("/update_weights_from_disk", json={"model_path": str(old)})
    assert client.post("/pause_generation").json() == {"success": True}
    done: list = []
    worker = threading.Thread(target=lambda: done.append(_complete(client)))
    worker.start()
    time.sleep(1.0)
    assert not done  # queued, not stepped
    assert client.post("/update_weights_from_disk", json={"model_path": str(new)}).status_code == 200
    assert client.post("/continue_generation").json() == {"success": True}
    worker.join(timeout=60)
    assert done == [ckpts["expected"]]  # computed under the new weights


def test_a_sleeping_engine_refuses_requests_until_it_wakes(served):
    _, client, _ = served
    assert client.post("/sleep", params={"level": 3}).status_code == 400
    assert client.post("/sleep", params={"level": 1}).json() == {"success": True, "level": 1}
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 503
    assert client.post("/wake_up").json() == {"success": True}
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert len(_complete(client)) == 8
