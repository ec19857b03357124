"""The bounded window cache: a sequence holds only the window blocks its window covers (the
compressed entries keep growing), outputs equal the unbounded layout's under batching,
chunking, preemption and prefix caching, and a prefix hit whose window was evicted is
shortened, not wrong."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def v4_small_blocks(tmp_path_factory):
    """Tiny V4 with HCA groups of 8 and 16-token blocks (window 8): many window blocks."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4s"), arch="deepseek_v4_short_groups", seed=3)


def test_window_bytes_stay_bounded_while_compressed_entries_grow(v4_small_blocks):
    """A 4,000-token request: from the window on, the window blocks in use never exceed the
    window's blocks plus one; the main blocks (compressed entries) grow with the length."""
    llm = LLM(str(v4_small_blocks), max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = llm.engine
    layout = engine.layout
    assert layout.bounded_window
    bound = layout.window_blocks_per_sequence()
    rng = random.Random(0)
    prompt = [rng.randrange(2, 258) for _ in range(3900)]
    request = engine.add_request("long", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        engine.step()
        report = llm.memory_report()["kv_cache"]
        if request.finished:
            break
        seen.append((request.num_computed_tokens, report["window_blocks_in_use"], report["blocks_in_use"]))
        # between steps: the window's blocks (and none while nothing is scheduled)
        assert report["window_blocks_in_use"] <= bound
        assert report["window_in_use_bytes"] == report["window_blocks_in_use"] * report["window_block_bytes"]
    tokens = [n for n, _, _ in seen]
    assert max(tokens) >= 3990  # a 4,000-token sequence
    main = [b for _, _, b in seen]
    assert main[-1] == -(-max(tokens) // layout.block_size)  # every block of entries kept
    assert main[-1] > 10 * bound


def _workload(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 258) for _ in range(rng.randrange(20, 90))]
    out = []
    for i in range(n):
        head = prefix if i % 2 else []
        prompt = head + [rng.randrange(2, 258) for _ in range(rng.randrange(1, 120))]
        out.append(
            (prompt, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0, ignore_eos=True))
        )
    return out


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.sampled_from([16, 40, 512]),
    blocks=st.sampled_from([None, 24]),
    async_scheduling=st.booleans(),
)
def test_bounded_and_unbounded_windows_give_the_same_tokens(
    v4_small_blocks, seed, budget, blocks, async_scheduling
):
    """Random workloads (shared prefixes, chunked prefill, preemption from a small cache,
    async scheduling): the bounded window's greedy tokens equal the unbounded layout's."""
    work = _workload(seed, 12)
    prompts, params = [p for p, _ in work], [q for _, q in work]
    outs = []
    for bounded in (True, False):
        llm = LLM(
            str(v4_small_blocks),
            bounded_window_cache=bounded,
            max_num_batched_tokens=budget,
            num_cache_blocks=blocks,
            async_scheduling=async_scheduling,
            max_num_seqs=8,
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        engine = llm.engine
        assert engine.block_pools[0].num_free == engine.num_blocks
        if bounded:  # nothing left held once every request finished
            assert engine.window_block_pools[0].num_free == engine.window_block_pools[0].num_blocks
    assert outs[0] == outs[1]


def test_a_prefix_hit_without_its_window_is_shortened(v4_small_blocks):
    """Evict every cached window block: a repeated prompt still hits where its window is
    cached (none here, so no hit) and gives the same tokens; with the window blocks kept it
    hits the whole prefix."""
    rng = random.Random(7)
    prompt = [rng.randrange(2, 258) for _ in range(100)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(v4_small_blocks), max_num_seqs=4)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # the whole prefix hit
    pool = llm.engine.window_block_pools[0]
    held = pool.allocate(pool.num_free)  # evicts every cached window block
    pool.free(held)
    third = llm.generate([prompt], params, use_tqdm=False)[0]
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    assert third.num_cached_tokens == 0
