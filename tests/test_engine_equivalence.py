"""Outputs under batching, chunked prefill, preemption, prefix caching and async scheduling
equal each request run alone (greedy)."""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams

NUM_REQUESTS = 200


def _workload(seed: int, vocab: int, shared_prefixes: bool) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, vocab) for _ in range(rng.randrange(130, 270))] for _ in range(4)]
    work = []
    for i in range(NUM_REQUESTS):
        if shared_prefixes and i % 2 == 0:
            prompt = rng.choice(prefixes) + [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 40))]
        elif i % 10 == 0:  # past two ratio-128 groups
            prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(257, 300))]
        else:
            prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 140))]
        work.append(
            (prompt, SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True))
        )
    return work


def _alone_runner(ckpt):
    """Reference: every request alone, synchronous, no prefix cache, one chunk per prompt."""
    llm = LLM(ckpt, async_scheduling=False, enable_prefix_caching=False, max_num_batched_tokens=512)
    cache: dict[int, list[list[int]]] = {}

    def run(seed: int, shared: bool) -> list[list[int]]:
        key = seed * 2 + shared
        if key not in cache:
            cache[key] = [
                llm.generate([p], q)[0].outputs[0].token_ids
                for p, q in _workload(seed, llm.vocab_size, shared)
            ]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def alone(v4_ckpt):
    return _alone_runner(v4_ckpt)


def _together(llm: LLM, seed: int, shared: bool) -> list[list[int]]:
    work = _workload(seed, llm.vocab_size, shared)
    outs = llm.generate([p for p, _ in work], [q for _, q in work])
    engine = llm.engine
    assert engine.pool.num_free == engine.num_blocks, "blocks leaked"
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_with_chunked_prefill(v4_ckpt, alone, async_scheduling):
    llm = LLM(v4_ckpt, async_scheduling=async_scheduling, max_num_batched_tokens=96, max_num_seqs=48)
    assert _together(llm, 1, False) == alone(1, False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_forced_by_a_tiny_cache(v4_ckpt, alone, async_scheduling):
    llm = LLM(
        v4_ckpt,
        async_scheduling=async_scheduling,
        num_cache_blocks=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    preemptions = []
    original = llm.engine.scheduler.preempt

    def counting_preempt(request):
        preemptions.append(request.request_id)
        original(request)

    llm.engine.scheduler.preempt = counting_preempt
    assert _together(llm, 2, False) == alone(2, False)
    assert len(preemptions) > 10


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_on_shared_prefixes(v4_ckpt, alone, async_scheduling):
    llm = LLM(v4_ckpt, async_scheduling=async_scheduling, max_num_batched_tokens=384)
    assert _together(llm, 3, True) == alone(3, True)
    assert llm.engine.pool.hit_rate > 0.2
    # a second pass is served mostly from the cache and still gives the same tokens
    work = _workload(3, llm.vocab_size, True)
    again = llm.generate([p for p, _ in work[:20]], [q for _, q in work[:20]])
    assert [o.outputs[0].token_ids for o in again] == alone(3, True)[:20]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_everything_at_once_on_short_groups(v4_short_ckpt):
    """HCA groups of 8 (many group closings mid-decode), 16-token blocks, sharded weights:
    chunked prefill, preemption, prefix caching and async scheduling all on together."""
    reference = _alone_runner(v4_short_ckpt)(4, True)
    llm = LLM(v4_short_ckpt, num_cache_blocks=40, max_num_batched_tokens=64, max_num_seqs=32)
    assert llm.engine.layout.block_size == 16
    assert _together(llm, 4, True) == reference
    assert llm.engine.pool.hit_blocks > 0
