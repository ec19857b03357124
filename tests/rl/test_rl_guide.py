"""The RL guide's promises (docs/guide/rl.md) that other tests leave out: ``refresh_weights``
announces writes PyTorch does not count, ``sync_weights`` applies a trainer's step at once,
names from a ``torch.compile``'d trainer module are accepted, ``from_model`` refuses what it
cannot share, weights survive a level-2 sleep as documented, replayed routing entries below 0
route by the gate, and ``/sleep?level=2`` works over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer
from rl_steps import save_checkpoint, tokens_and_logprob_dicts, train_step

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.server.app import build_app
from deepinfer.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 9, 17, 33, 2, 8, 40, 41, 7, 12], [100, 3, 61, 200], [11, 12, 13, 14, 15, 16, 17]]
EAGER = {"compile": False}

Result = list[tuple[list[int], list[dict[int, float]]]]


def _result(llm: LLM) -> Result:
    """Greedy tokens and their logprobs for ``PROMPTS`` (compared exactly)."""
    return tokens_and_logprob_dicts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def _versions(llm: LLM) -> set[str | None]:
    return {o.weight_version for o in llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two tiny Llamas of the same shapes and their fresh engines' outputs."""
    old = make_tiny_checkpoint(tmp_path_factory.mktemp("old"), arch="llama", seed=3)
    new = make_tiny_checkpoint(tmp_path_factory.mktemp("new"), arch="llama", seed=4)
    expected = {"old": _result(LLM(old, **EAGER)), "new": _result(LLM(new, **EAGER))}
    assert expected["old"] != expected["new"]
    return {"old": old, "new": new, "expected": expected}


# ---- refresh_weights / sync_weights ---------------------------------------------------------


def test_refresh_weights_announces_writes_pytorch_does_not_count(ckpts):
    """Writes through ``p.data`` bump no version counter; after ``refresh_weights`` the engine
    computes with them, as an engine built from a checkpoint of those weights does."""
    model = load_model(ckpts["old"], requires_grad=True)
    llm = LLM.from_model(model, **EAGER)
    assert _result(llm) == ckpts["expected"]["old"]
    new = load_model(ckpts["new"]).state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data.copy_(new[name])  # not seen by the version counters
    assert llm.refresh_weights() == "1"
    assert _result(llm) == ckpts["expected"]["new"]
    assert _versions(llm) == {"1"}


def test_sync_weights_applies_a_trainers_step_at_once(ckpts, tmp_path):
    """``sync_weights`` after an optimizer step makes the copies and moves the version then;
    the next step finds nothing left to apply and computes with the new weights."""
    model = load_model(ckpts["old"], requires_grad=True)
    llm = LLM.from_model(model, **EAGER)
    _result(llm)
    train_step(model, 0, 0.5, 16)
    assert llm.sync_weights() == "1" and llm.weight_version == "1"
    expected = _result(LLM(save_checkpoint(model, Path(ckpts["old"]), tmp_path / "step1"), **EAGER))
    assert _result(llm) == expected
    assert _versions(llm) == {"1"}  # the step did not count the same write again
    train_step(model, 1, 0.5, 16)
    assert llm.sync_weights(weight_version="policy-2") == "policy-2"
    assert _versions(llm) == {"policy-2"}


def test_names_from_a_compiled_trainer_module_are_accepted(ckpts):
    """A ``torch.compile``'d module names its parameters ``_orig_mod.<name>``:
    ``update_weights`` takes them as the model's own names (DDP's ``module.``:
    test_weight_updates.py)."""
    compiled = torch.compile(load_model(ckpts["new"]))
    state = compiled.state_dict()
    assert all(name.startswith("_orig_mod.") for name in state)
    llm = LLM(ckpts["old"], **EAGER)
    assert llm.update_weights(state, weight_version="compiled") == "compiled"
    assert _result(llm) == ckpts["expected"]["new"]


# ---- from_model refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "option,match",
    [
        ({"data_parallel_size": 2}, "data_parallel_size"),
        ({"data_parallel_replicas": 2}, "data_parallel_replicas"),
        ({"quantization": "fp8"}, "fp8"),
    ],
)
def test_from_model_refuses_what_would_not_share_the_trainers_parameters(ckpts, option, match):
    """Replicas or data-parallel ranks would hold their own copies of the weights, and fp8
    replaces the linears: an engine over a trainer's module refuses them by name."""
    model = load_model(ckpts["old"], requires_grad=True)
    with pytest.raises(ValueError, match=match):
        LLM.from_model(model, **EAGER, **option)


# ---- level-2 sleep after an update ----------------------------------------------------------


@pytest.mark.parametrize("how", ["load_weights_from_disk", "update_weights", "trainer"])
def test_level_two_wake_up_after_an_update(ckpts, tmp_path, how):
    """Level 2 reads the last checkpoint loaded from disk back in place: a checkpoint loaded
    with ``load_weights_from_disk`` survives, weights pushed with ``update_weights`` are the
    disk checkpoint's again until pushed anew, and a trainer's module keeps its own (stepped)
    parameters. Outputs carry the version of the weights that computed them."""
    old, new = ckpts["old"], ckpts["new"]
    if how == "trainer":
        model = load_model(old, requires_grad=True)
        llm = LLM.from_model(model, **EAGER)
        _result(llm)
        train_step(model, 0, 0.5, 16)
        expected, version = _result(LLM(save_checkpoint(model, Path(old), tmp_path / "step1"), **EAGER)), "1"
    else:
        llm = LLM(old, **EAGER)
        _result(llm)
        if how == "load_weights_from_disk":
            llm.load_weights_from_disk(new)
            expected, version = ckpts["expected"]["new"], "1"
        else:
            llm.update_weights(load_model(new).state_dict())
            assert _result(llm) == ckpts["expected"]["new"]
            expected, version = ckpts["expected"]["old"], "0"
    llm.sleep(level=2)
    llm.wake_up()
    assert _result(llm) == expected
    assert _versions(llm) == {version}
    if how == "update_weights":  # pushed again, the update lands
        llm.update_weights(load_model(new).state_dict())
        assert _result(llm) == ckpts["expected"]["new"]


# ---- routing replay ------------------------------------------------------------------------


def test_replay_entries_below_zero_route_by_the_gate(v4_ckpt):
    """In ``model(ids, routed_experts=...)``, an entry below 0 (any negative value) routes as
    the gate does, and positions past the given rows too: replacing some of the rollout's own
    entries by negatives, or cutting its rows short, changes no logit, while other experts in
    the same places do."""
    model = load_model(v4_ckpt, requires_grad=True)
    llm = LLM.from_model(model, enable_return_routed_experts=True)
    prompt = [5, 17, 99, 3, 42, 7, 8, 9, 61, 200, 4, 12, 33, 150, 21, 6]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    rows = out.routed_experts.long()
    experts = model.config.n_routed_experts

    def logits(routing: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, routed_experts=[routing]).logits

    replayed = logits(rows)
    masked = rows.clone()
    masked[::2] = -1  # whole positions
    masked[1::4, 0] = -7  # one layer of a position, another negative value
    masked[3::4, :, 0] = -1  # one of the k entries
    assert (masked < 0).any() and (masked >= 0).any()
    assert torch.equal(logits(masked), replayed)
    assert torch.equal(logits(rows[: len(rows) // 2]), replayed)  # positions past the rows
    other = torch.where(masked < 0, (rows + 1) % experts, rows)  # other experts where masked
    assert not torch.allclose(logits(other), replayed)


# ---- /sleep?level=2 over HTTP ---------------------------------------------------------------


def test_sleep_level_two_over_http(ckpts):
    """``POST /sleep?level=2`` gives the weights' pages back (the parameters are zeroed),
    completions answer 503 until ``/wake_up``, and then equal those before the sleep."""
    llm = LLM(ckpts["old"], **EAGER)
    live = LiveServer(build_app(llm, "tiny", enable_rl_endpoints=True))
    json_headers = {"Content-Type": "application/json"}
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.0, "logprobs": 1}
    body["ignore_eos"] = True
    try:
        client = httpx.Client(base_url=live.url, timeout=120, headers=json_headers)
        before = client.post("/v1/completions", json=body)
        assert before.status_code == 200, before.text
        resp = client.post("/sleep", params={"level": 2}, content=b"{}")
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"success": True, "level": 2}
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert all(not p.any() for p in llm.model.parameters())  # level 2, not level 1
        assert client.post("/v1/completions", json=body).status_code == 503
        assert client.post("/wake_up", content=b"{}").json() == {"success": True}
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        after = client.post("/v1/completions", json=body)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["logprobs"] == before.json()["choices"][0]["logprobs"]
    finally:
        live.stop()
