"""Engine-core equivalence on tiny V4.1: alone == batched == chunked == preempted ==
prefix-cached (greedy, with the QAT fake-quant on, as the model runs by default).

V4.1 adds cache state V4 does not have: compressed entries and index keys shared across
layers, and Engram's per-token n-gram history; all must survive chunking, preemption and
prefix-cache hits.
"""

from __future__ import annotations

import pytest
from equivalence_workloads import alone_runner, count_preemptions, together

from deepinfer import LLM

NUM = 48  # requests per workload (the V4.1 tiny model is 4x wider than the V4 one)


@pytest.fixture(scope="module")
def alone(v41_ckpt):
    return alone_runner(v41_ckpt, NUM)


def test_cache_layout_shares_entries(v41_ckpt):
    llm = LLM(v41_ckpt, num_cache_blocks=16)
    pools = llm.engine.runner.pools
    specs = llm.model.cache_spec()
    assert [s.shared_from for s in specs] == [None, None, None, 2, None, 4]
    assert [s.ratio for s in specs] == [0, 0, 2, 2, 1, 1]
    assert [s.token_ids for s in specs] == [False, True, False, False, False, False]
    assert pools[3].entries is pools[2].entries and pools[3].index_keys is pools[2].index_keys
    assert pools[5].entries is pools[4].entries and pools[5].compressor is None
    assert pools[1].token_ids is not None and pools[1].token_ids.dtype.is_floating_point is False


def test_batched_with_chunked_prefill(v41_ckpt, alone):
    llm = LLM(v41_ckpt, async_scheduling=False, max_num_batched_tokens=72, max_num_seqs=24)
    assert together(llm, 1, False, NUM) == alone(1, False)


def test_preemption_forced_by_a_tiny_cache(v41_ckpt, alone):
    llm = LLM(v41_ckpt, num_cache_blocks=20, max_num_batched_tokens=256, enable_prefix_caching=False)
    preemptions = count_preemptions(llm)
    assert together(llm, 2, False, NUM) == alone(2, False)
    assert preemptions, "the tiny cache must force preemption"


def test_prefix_caching_and_async_on_shared_prefixes(v41_ckpt, alone):
    llm = LLM(v41_ckpt, async_scheduling=True, max_num_batched_tokens=160)
    assert together(llm, 3, True, NUM) == alone(3, True)
    assert llm.engine.block_pools[0].hit_rate > 0.2
