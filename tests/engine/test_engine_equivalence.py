"""Outputs under batching, chunked prefill, preemption, prefix caching and async scheduling
equal each request run alone (greedy)."""

from __future__ import annotations

import pytest
from equivalence_workloads import alone_runner, count_preemptions, together, workload

from deepinfer import LLM


@pytest.fixture(scope="module")
def alone(v4_ckpt):
    return alone_runner(v4_ckpt)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_with_chunked_prefill(v4_ckpt, alone, async_scheduling):
    llm = LLM(v4_ckpt, async_scheduling=async_scheduling, max_num_batched_tokens=96, max_num_seqs=48)
    assert together(llm, 1, False) == alone(1, False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_forced_by_a_tiny_cache(v4_ckpt, alone, async_scheduling):
    llm = LLM(
        v4_ckpt,
        async_scheduling=async_scheduling,
        num_cache_blocks=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    preemptions = count_preemptions(llm)
    assert together(llm, 2, False) == alone(2, False)
    assert len(preemptions) > 10


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_on_shared_prefixes(v4_ckpt, alone, async_scheduling):
    llm = LLM(v4_ckpt, async_scheduling=async_scheduling, max_num_batched_tokens=384)
    assert together(llm, 3, True) == alone(3, True)
    assert llm.engine.block_pools[0].hit_rate > 0.2
    # a second pass is served mostly from the cache and still gives the same tokens
    work = workload(3, llm.vocab_size, True)
    again = llm.generate([p for p, _ in work[:20]], [q for _, q in work[:20]])
    assert [o.outputs[0].token_ids for o in again] == alone(3, True)[:20]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_everything_at_once_on_short_groups(v4_short_ckpt):
    """HCA groups of 8 (many group closings mid-decode), 16-token blocks, sharded weights:
    chunked prefill, preemption, prefix caching and async scheduling all on together."""
    reference = alone_runner(v4_short_ckpt)(4, True)
    llm = LLM(v4_short_ckpt, num_cache_blocks=40, max_num_batched_tokens=64, max_num_seqs=32)
    assert llm.engine.layout.block_size == 16
    assert together(llm, 4, True) == reference
    assert llm.engine.block_pools[0].hit_blocks > 0
