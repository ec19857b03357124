"""``/v1/completions`` with ``echo``: the text is the prompt then the completion, and with
``logprobs`` the prompt tokens carry theirs (the first one null, as OpenAI and vLLM report
it), equal to the offline ``prompt_logprobs`` and to transformers' on the same checkpoint;
``max_tokens=0`` echoes the prompt alone; ``text_offset`` points at each token in the text;
combinations the endpoint does not serve are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import LiveServer

from deepinfer import LLM, SamplingParams
from deepinfer.server.app import build_app

NAME = "smol"
TOL = 1e-4
PROMPTS = ["The capital of France is", "Water boils at one hundred degrees"]
TOP = 2


@pytest.fixture(scope="module")
def served():
    """The app over SmolLM2 (float32), with what the offline engine and transformers say of
    the prompts, computed before the server takes the engine."""
    from transformers import AutoModelForCausalLM

    llm = LLM("smollm2-135m", max_num_seqs=8, max_model_len=256)
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP))
    hf = AutoModelForCausalLM.from_pretrained(str(llm.path), dtype=torch.float32).eval()
    reference = []
    for out in offline:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            logp = hf(ids).logits[0].float().log_softmax(-1)
        reference.append([float(logp[i - 1, t]) for i, t in enumerate(out.prompt_token_ids) if i > 0])
    del hf
    live = LiveServer(build_app(llm, NAME))
    client = httpx.Client(base_url=live.url, timeout=120, headers={"content-type": "application/json"})
    yield client, llm, offline, reference
    client.close()
    live.stop()


def complete(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", content=json.dumps({"model": NAME, "temperature": 0.0, **body}))


def prompt_gap(token_logprobs: list, reference: list[float]) -> float:
    """Largest difference between the echoed prompt logprobs (after the first, null one) and
    a reference for prompt tokens 1..n-1."""
    echoed = token_logprobs[1 : 1 + len(reference)]
    if token_logprobs[0] is not None or len(echoed) != len(reference) or None in echoed:
        return float("inf")
    return max(abs(a - b) for a, b in zip(echoed, reference, strict=True))


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echoed_prompt_logprobs_equal_offline_and_transformers(served, as_ids, max_tokens):
    client, llm, offline, reference = served
    prompt = [o.prompt_token_ids for o in offline] if as_ids else PROMPTS
    r = complete(client, prompt=prompt, max_tokens=max_tokens, logprobs=TOP, echo=True)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == len(PROMPTS)
    for choice, out, ref in zip(choices, offline, reference, strict=True):
        lp = choice["logprobs"]
        n = len(out.prompt_token_ids)
        assert len(lp["tokens"]) == n + max_tokens
        offline_lps = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0]
        assert prompt_gap(lp["token_logprobs"], offline_lps) < TOL
        assert prompt_gap(lp["token_logprobs"], ref) < TOL
        assert lp["top_logprobs"][0] is None
        for i in range(1, n):
            want = {llm.tokenizer.decode([k]): v.logprob for k, v in out.prompt_logprobs[i].items()}
            assert lp["top_logprobs"][i].keys() == want.keys()
        assert choice["text"].startswith(llm.tokenizer.decode(out.prompt_token_ids))


def test_a_shifted_echo_fails_the_comparison(served):
    """Mutation check of the test above: logprobs one position late are caught."""
    client, llm, offline, reference = served
    r = complete(client, prompt=PROMPTS[0], max_tokens=0, logprobs=1, echo=True)
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert prompt_gap(lps, reference[0]) < TOL
    assert prompt_gap([None, None, *lps[1:-1]], reference[0]) > TOL
    assert prompt_gap([None, *lps[2:], lps[-1]], reference[0]) > TOL


def test_max_tokens_zero_echoes_the_prompt_alone(served):
    client, llm, offline, _ = served
    r = complete(client, prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPTS[0] and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(offline[0].prompt_token_ids)


def test_the_echoed_completion_keeps_its_logprobs(served):
    """The generated tokens after the echoed prompt carry what a plain request reports."""
    client, *_ = served
    plain = complete(client, prompt=PROMPTS[1], max_tokens=3, logprobs=1).json()["choices"][0]
    echoed = complete(client, prompt=PROMPTS[1], max_tokens=3, logprobs=1, echo=True).json()["choices"][0]
    assert echoed["text"] == PROMPTS[1] + plain["text"]
    assert echoed["logprobs"]["tokens"][-3:] == plain["logprobs"]["tokens"]
    gaps = [
        abs(a - b)
        for a, b in zip(
            echoed["logprobs"]["token_logprobs"][-3:], plain["logprobs"]["token_logprobs"], strict=True
        )
    ]
    assert max(gaps) < TOL
    assert plain["logprobs"]["text_offset"][0] == 0


def test_n_siblings_each_echo_the_prompt(served):
    client, *_ = served
    r = complete(client, prompt=PROMPTS[0], max_tokens=2, n=2, logprobs=0, echo=True)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["text"].startswith(PROMPTS[0])
        assert choice["logprobs"]["token_logprobs"][0] is None


def offsets_point_at_tokens(text: str, logprobs: dict) -> bool:
    """Each token's text sits at its ``text_offset`` in the choice's text."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    return len(offsets) == len(tokens) and all(
        text[o : o + len(t)] == t for o, t in zip(offsets, tokens, strict=True)
    )


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.text(alphabet="abcdefgh XYZ.,!?0123", min_size=1, max_size=40).filter(lambda s: s.strip()),
    max_tokens=st.integers(0, 2),
)
def test_echo_text_and_offsets(served, prompt, max_tokens):
    client, llm, *_ = served
    r = complete(client, prompt=prompt, max_tokens=max_tokens, logprobs=0, echo=True, ignore_eos=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(llm.tokenizer(prompt).input_ids) + max_tokens
    assert offsets_point_at_tokens(choice["text"], choice["logprobs"])
    assert choice["logprobs"]["text_offset"][0] == 0


def test_the_offset_check_sees_a_shift():
    """Mutation check of the property above."""
    logprobs = {"tokens": ["The", " cat", " sat"], "text_offset": [0, 3, 7]}
    assert offsets_point_at_tokens("The cat sat", logprobs)
    assert not offsets_point_at_tokens("The cat sat", {**logprobs, "text_offset": [0, 4, 8]})


@pytest.mark.parametrize(
    "body,param",
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"echo": True, "logprobs": 1000}, "logprobs"),
        ({"echo": "yes"}, "echo"),
    ],
)
def test_unsupported_combinations_name_the_field(served, body, param):
    client, *_ = served
    r = complete(client, prompt=PROMPTS[0], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
