"""One request that goes wrong fails alone: the others in its batch finish with the tokens
they have when run alone.

Faults are injected where a hostile input or a numerical accident would put them: NaN logits
in one row (greedy and sampled), a sampling setting past validation, an exception in one
request's output processing, and an exception in the step itself (which fails that step's
requests and no others)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.executor import StepOutput
from deepinfer.errors import EngineDeadError
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def alone_engine(llama_path):
    """The reference: each request alone."""
    return LLM(llama_path, max_num_seqs=1, enable_prefix_caching=False, num_cache_blocks=64)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engines(request, llama_path, alone_engine):
    """A batching engine (synchronous, or scheduling each step while the last one runs, as on
    CUDA: a request can fail after its next step was scheduled) and the reference."""
    batched = LLM(
        llama_path,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_cache_blocks=128,
        async_scheduling=request.param,
    )
    return batched, alone_engine


def params_of(draw_seed: int, greedy: bool, max_tokens: int) -> SamplingParams:
    if greedy:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=draw_seed, ignore_eos=True)


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(2, 120), min_size=1, max_size=40),  # prompt
        st.booleans(),  # greedy
        st.integers(1, 8),  # max_tokens
    ),
    min_size=2,
    max_size=6,
)


def expected_alone(alone: LLM, work) -> list[list[int]]:
    return [
        alone.generate([prompt], params_of(i, greedy, n), use_tqdm=False)[0].outputs[0].token_ids
        for i, (prompt, greedy, n) in enumerate(work)
    ]


def nan_rows_of(engine, victim: str, after: int):
    """Wraps ``engine.executor.run``: the victim's sampled row is NaN from its ``after``-th token on."""
    real = engine.executor.run

    def execute(prepared, input_ids):
        output = real(prepared, input_ids)
        logits = output.logits
        for chunk, row in zip(prepared.chunks, prepared.sample_rows, strict=True):
            req = chunk.request
            # the index of the token the row samples (the host's lists may lag a launched step)
            if row >= 0 and req.request_id == victim and chunk.end - len(req.prompt_token_ids) >= after:
                logits = logits.clone()
                logits[row] = math.nan
        return StepOutput(logits, output.features, output.forward_s)

    return execute


def check_leaks(engine) -> None:
    """Every block free and no request left (an asynchronous engine may still hold a launched
    step of finished requests, which its next step drops)."""
    assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"
    assert not engine.requests and not engine.scheduler.num_unfinished


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(work=workloads, victim=st.integers(0, 5), after=st.integers(0, 3))
def test_nan_logits_in_one_row_fail_that_request_alone(engines, monkeypatch, work, victim, after):
    batched, alone = engines
    victim %= len(work)
    expected = expected_alone(alone, work)
    engine = batched.engine
    ids = [f"r{i}" for i in range(len(work))]
    with monkeypatch.context() as m:
        m.setattr(engine.executor, "run", nan_rows_of(engine, ids[victim], after))
        for rid, (i, (prompt, greedy, n)) in zip(ids, enumerate(work), strict=True):
            engine.add_request(rid, prompt, params_of(i, greedy, n))
        outs = {}
        while engine.has_unfinished():
            for req in engine.step():
                if req.finished:
                    outs[req.request_id] = engine.make_output(req).outputs[0]
        for rid in ids:
            engine.pop_finished(rid)
    check_leaks(engine)
    for i, rid in enumerate(ids):
        if i == victim and after < work[i][2]:
            assert outs[rid].finish_reason == "error" and "not finite" in outs[rid].error
            assert outs[rid].token_ids == expected[i][:after]  # its tokens before the fault
        else:
            assert outs[rid].finish_reason == "length" and outs[rid].token_ids == expected[i], rid


def test_a_setting_past_validation_fails_its_request_alone(engines):
    """A temperature that overflows the logits to inf (validation raises such values to the
    floor; set here after it) makes that row NaN, and only that row."""
    batched, alone = engines
    work = [([5, 6, 7], False, 6), ([9, 10], True, 6), ([11, 12, 13, 14], False, 6)]
    expected = expected_alone(alone, work)
    params = [params_of(i, g, n) for i, (_, g, n) in enumerate(work)]
    params[0].temperature = 1e-45  # what SamplingParams would have raised to 0.01
    outs = batched.generate([p for p, _, _ in work], params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in outs[1:]] == expected[1:]
    check_leaks(batched.engine)


def test_an_exception_in_one_requests_output_processing_fails_it_alone(engines, monkeypatch):
    batched, alone = engines
    work = [([5, 6, 7], True, 5), ([9, 10], True, 5), ([3, 4], False, 5)]
    expected = expected_alone(alone, work)
    processor = batched.engine.output_processor
    real = processor.append_token

    def append_token(req, token, row_logits):
        if req.prompt_token_ids == [9, 10]:  # the second request
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, token, row_logits)

    monkeypatch.setattr(processor, "append_token", append_token)
    outs = batched.generate([p for p, _, _ in work], [params_of(i, g, n) for i, (_, g, n) in enumerate(work)])
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "error", "length"], reasons
    assert "UnicodeDecodeError" in outs[1].outputs[0].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [expected[0], expected[2]]
    check_leaks(batched.engine)


def test_a_step_that_raises_fails_its_requests_and_no_others(llama_path, monkeypatch):
    """Two slots, four requests: the first step (the first two requests' prefill) raises.
    Those two fail with "error"; the two that waited run afterwards with their own tokens."""
    llm = LLM(llama_path, max_num_seqs=2, num_cache_blocks=64)
    alone = LLM(llama_path, max_num_seqs=1, enable_prefix_caching=False, num_cache_blocks=64)
    work = [([5, 6, 7], True, 4), ([9, 10], True, 4), ([3, 4, 5, 6], False, 4), ([8], True, 4)]
    expected = expected_alone(alone, work)
    engine = llm.engine
    real = engine.executor.run
    calls = {"n": 0}

    def execute(prepared, input_ids):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real(prepared, input_ids)

    monkeypatch.setattr(engine.executor, "run", execute)
    outs = llm.generate([p for p, _, _ in work], [params_of(i, g, n) for i, (_, g, n) in enumerate(work)])
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length", "length"]
    assert "injected step failure" in outs[0].outputs[0].error
    assert [o.outputs[0].token_ids for o in outs[2:]] == expected[2:]
    check_leaks(engine)


def test_a_step_that_fails_before_holding_requests_ends_the_engine(llama_path, monkeypatch):
    """A failure in scheduling itself blames no request and would recur on every retry: the
    engine reports itself dead (``EngineDeadError``) instead of stepping forever."""
    llm = LLM(llama_path, max_num_seqs=2, num_cache_blocks=64)
    calls = {"n": 0}

    def schedule(drafts=None):
        calls["n"] += 1
        raise RuntimeError("injected scheduler failure")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", schedule)
    with pytest.raises(EngineDeadError, match="injected scheduler failure"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert calls["n"] == 1
