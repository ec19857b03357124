"""``data_parallel_replicas``: ``LLM.generate`` split over whole engines in worker processes.

The outputs must be those of one engine (each request's tokens do not depend on which replica
or batch computed it), in the caller's order and with its request ids; a bad prompt fails the
whole call before any replica starts; a dead worker is an error naming it; scripts without a
``__main__`` guard can start replicas."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parallel_workloads import assert_same, tokens_and_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.replicas import balanced_shares
from deepinfer.tiny import make_tiny_checkpoint


def _best_max_load(costs: list[int], parts: int) -> int:
    return min(
        max(sum(c for c, p in zip(costs, assign, strict=True) if p == k) for k in range(parts))
        for assign in itertools.product(range(parts), repeat=len(costs))
    )


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=0, max_size=7),
    parts=st.integers(1, 3),
)
def test_balanced_shares_split_every_index_once_within_lpts_bound(costs, parts):
    """Every index in exactly one share, shares in index order and lightest first, and the
    heaviest share within 4/3 of the best split (LPT's bound, checked against brute force;
    a round-robin split fails it, e.g. costs [10, 1, 10, 1] on two shares)."""
    shares = balanced_shares(costs, parts)
    assert len(shares) == parts
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(costs[i] for i in share) for share in shares]
    assert loads == sorted(loads)
    if costs:
        assert 3 * max(loads) <= 4 * _best_max_load(costs, parts)


def test_balanced_shares_refuses_no_parts():
    with pytest.raises(ValueError, match="parts"):
        balanced_shares([1, 2], 0)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """One tiny V4 as two replicas and as one engine (eager steps: the test is about the split)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("v4rep"), arch="deepseek_v4", seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = LLM(path, compile=False, data_parallel_replicas=2, max_num_seqs=16)
        one = LLM(path, compile=False, max_num_seqs=16)
    finally:
        torch.set_num_threads(before)
    yield path, two, one
    two.close()
    one.close()


def _mixed_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random prompts and params: greedy and seeded sampling, n = 1 and 2, logprobs, stop ids."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(2, 258) for _ in range(rng.randrange(1, 60))] for _ in range(rng.randrange(2, 12))
    ]
    params = [
        SamplingParams(
            max_tokens=rng.randrange(1, 14),
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            n=rng.choice([1, 1, 2]),
            logprobs=1,
            ignore_eos=rng.random() < 0.7,
            stop_token_ids=[rng.randrange(2, 258)] if rng.random() < 0.3 else [],
        )
        for _ in prompts
    ]
    return prompts, params


def _per_completion(outs):
    """Tokens and chosen-token logprobs of every completion, siblings included."""
    flat = []
    for o in outs:
        for c in o.outputs:
            flat.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]))
    return flat


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_replicas_give_one_engines_outputs_in_order(replicated, seed):
    _, two, one = replicated
    prompts, params = _mixed_workload(seed)
    got = two.generate(prompts, params, use_tqdm=False)
    want = one.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in got] == [p.n for p in params]
    assert [o.prompt_token_ids for o in got] == prompts
    assert [[c.finish_reason for c in o.outputs] for o in got] == [
        [c.finish_reason for c in o.outputs] for o in want
    ]
    assert_same(_per_completion(got), _per_completion(want))
    ids = [o.request_id for o in got]
    assert len(set(ids)) == len(ids)
    # the workers' engines hold nothing afterwards: the next call finds them empty
    assert not two.engine.requests


def test_replicas_split_the_work_and_count_progress(replicated, capsys, monkeypatch):
    """Both replicas compute (half the requests finish in the caller's engine, the rest
    in the worker's) and the progress bar counts every request, the workers' included."""
    _, two, one = replicated
    prompts = [[3 + i, 5, 7 + i] for i in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    finished_here: set[str] = set()
    step = two.engine.step

    def counting_step():
        updated = step()
        finished_here.update(r.request_id for r in updated if r.finished)
        return updated

    monkeypatch.setattr(two.engine, "step", counting_step)
    outs = two.generate(prompts, params, use_tqdm=True)
    assert len(finished_here) == 4  # equal costs: four requests each
    assert "8/8" in capsys.readouterr().err
    assert_same(tokens_and_logprobs(outs), tokens_and_logprobs(one.generate(prompts, params, use_tqdm=False)))


def test_a_bad_prompt_fails_the_call_before_any_replica_runs(replicated):
    _, two, _ = replicated
    prompts = [[5, 6, 7], [8, 9], [10**6]]
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        two.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert not two.engine.requests
    outs = two.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_a_call_failing_here_leaves_no_result_for_the_next(replicated, monkeypatch):
    """The caller's share fails while a worker computes its own: the call raises, nothing stays
    queued, and the worker's result is not read as the next call's (whose outputs must be that
    call's own)."""
    _, two, one = replicated
    first = [[11, 12, 13], [14, 15, 16]]
    second = [[21, 22], [23, 24, 25, 26]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)

    def failing_step():
        raise RuntimeError("a step failed")

    monkeypatch.setattr(two.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="a step failed"):
        two.generate(first, params, use_tqdm=False)
    monkeypatch.undo()
    assert not two.engine.requests
    got = two.generate(second, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == second
    assert_same(tokens_and_logprobs(got), tokens_and_logprobs(one.generate(second, params, use_tqdm=False)))


def test_options_are_checked(replicated):
    path, two, _ = replicated
    from deepinfer.server.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="the server runs one engine"):
        AsyncLLM(two)
    with pytest.raises(ValueError, match="data_parallel_replicas"):
        LLM(path, data_parallel_replicas=0)
    with pytest.raises(ValueError, match="device"):
        LLM(path, data_parallel_replicas=2, device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, data_parallel_replicas=2, tensor_parallel_size=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(ValueError, match="at least 2 CPU threads"):
            LLM(path, data_parallel_replicas=2)
    finally:
        torch.set_num_threads(before)


def test_a_dead_replica_is_named(tmp_path, two_threads):
    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4", seed=4)
    llm = LLM(path, compile=False, data_parallel_replicas=2)
    try:
        assert llm._replicas is not None
        llm._replicas.procs[0].kill()
        llm._replicas.procs[0].wait()
        with pytest.raises(RuntimeError, match="replica 1 exited"):
            llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.engine.requests  # the failed call left nothing queued
    finally:
        llm.close()


def test_a_script_without_a_main_guard_starts_replicas(tmp_path):
    """Workers are fresh interpreters sent their task over a socket: the caller's script is
    never imported again (multiprocessing's spawn would run it a second time and fail)."""
    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4", seed=5)
    script = tmp_path / "no_guard.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from deepinfer import LLM, SamplingParams
            torch.set_num_threads(2)
            llm = LLM({str(path)!r}, compile=False, data_parallel_replicas=2)
            outs = llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=3, temperature=0.0))
            print("lengths", [len(o.outputs[0].token_ids) for o in outs])
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lengths [3, 3, 3]" in done.stdout
