"""The device-resident token path: an asynchronous engine launches step N+1 with step N's
tokens still on the device, and its outputs equal the synchronous engine's on random
workloads (seeded sampling, stop strings, penalties, structured outputs, speculative
decoding, chunked prefill, preemption from a small cache)."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.tiny import make_tiny_checkpoint

VOCAB = 256


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("async_llama") / "llama", arch="llama"))


def _params(rng: random.Random, kinds: list[str]) -> SamplingParams:
    kind = rng.choice(kinds)
    base = {"max_tokens": rng.randrange(1, 24), "ignore_eos": rng.random() < 0.7}
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **base)
    if kind == "seeded":
        return SamplingParams(
            temperature=rng.choice([0.7, 1.0, 1.3]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([-1, 20]),
            seed=rng.randrange(1000),
            **base,
        )
    if kind == "stop":  # stop strings end a request mid-pipeline (text known only on the host)
        return SamplingParams(temperature=0.0, stop=["e", "a "], **base)
    if kind == "penalty":  # a logits processor reading the output: sampled on the host
        return SamplingParams(temperature=0.9, seed=rng.randrange(1000), repetition_penalty=1.3, **base)
    if kind == "logprobs":  # their logits rows go home beside the tokens
        return SamplingParams(temperature=0.8, seed=rng.randrange(1000), logprobs=2, **base)
    if kind == "regex":  # a grammar mask: sampled on the host after the last step is processed
        return SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": "[ab]{2,6}"})
    raise AssertionError(kind)


def _workload(seed: int, kinds: list[str], n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 24))]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    return prompts, [_params(rng, kinds) for _ in range(n)]


def _run(ckpt: str, prompts, params, asynchronous: bool | None, **options) -> tuple[list, LLM]:
    llm = LLM(ckpt, async_scheduling=asynchronous, max_num_seqs=6, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.block_pools[0].num_free == engine.num_blocks  # nothing left held
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, _logprobs(o.outputs[0])) for o in outs], llm


def _logprobs(completion) -> list | None:
    """Each step's reported (token, rank, logprob)."""
    if completion.logprobs is None:
        return None
    return [sorted((t, lp.rank, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]


def _same(got: list, want: list) -> bool:
    """Equal tokens, finish reasons and logprob tokens and ranks; logprob values within 1e-4
    (the two engines' logits may differ in their last bits with the batch a row ran in)."""
    if len(got) != len(want):
        return False
    for (tokens, reason, steps), (want_tokens, want_reason, want_steps) in zip(got, want, strict=True):
        if tokens != want_tokens or reason != want_reason or (steps is None) != (want_steps is None):
            return False
        for step, want_step in zip(steps or [], want_steps or [], strict=True):
            if [(t, r) for t, r, _ in step] != [(t, r) for t, r, _ in want_step]:
                return False
            if any(abs(a[2] - b[2]) > 1e-4 for a, b in zip(step, want_step, strict=True)):
                return False
    return True


KINDS = ["greedy", "seeded", "stop", "logprobs", "penalty", "regex"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True),
    budget=st.sampled_from([32, 64, 512]),
    blocks=st.sampled_from([None, 10]),
)
def test_async_engine_equals_sync_engine(llama_ckpt, seed, kinds, budget, blocks):
    prompts, params = _workload(seed, kinds, 10)
    options = {"max_num_batched_tokens": budget, "num_cache_blocks": blocks, "block_size": 16}
    sync, _ = _run(llama_ckpt, prompts, params, False, **options)
    got, llm = _run(llama_ckpt, prompts, params, True, **options)
    assert _same(got, sync), (got, sync)
    steps = llm.engine.async_steps
    assert steps is not None
    if set(kinds) <= {"greedy", "seeded", "stop", "logprobs"}:  # every row plain: the host never waits
        assert steps.host_waits == 0 and steps.early_launches > 0


def test_speculative_decoding_steps_synchronously(llama_ckpt, caplog):
    """With n-gram drafting on, asking for asynchronous scheduling changes no output: the
    drafter needs the last tokens on the host, so such an engine steps synchronously, and
    says so."""
    rng = random.Random(3)
    prompts = [[5, 6, 7, 8] * 6 + [rng.randrange(3, VOCAB) for _ in range(4)] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)
    ]
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    sync, _ = _run(llama_ckpt, prompts, params, False, **spec)
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        got, llm = _run(llama_ckpt, prompts, params, True, **spec)
    assert llm.engine.async_steps is None
    assert "steps run synchronously" in caplog.text
    assert _same(got, sync)


def test_a_wrong_feed_is_caught(llama_ckpt, monkeypatch):
    """Mutation check: feeding each row the token of another row makes the asynchronous
    engine's outputs differ from the synchronous engine's on the same workload."""
    prompts, params = _workload(11, ["greedy"], 6)
    sync, _ = _run(llama_ckpt, prompts, params, False)
    real = ModelRunner.feed

    def shifted(ids, pairs, tokens):
        if pairs.shape[1] > 1:
            pairs = pairs.clone()
            pairs[1] = pairs[1].roll(1)
        return real(ids, pairs, tokens)

    monkeypatch.setattr(ModelRunner, "feed", staticmethod(shifted))
    got, _ = _run(llama_ckpt, prompts, params, True)
    assert not _same(got, sync)
