"""Property tests: the scheduler and block pool under random workloads, without a model.

After any sequence of arrivals, steps (with random finishes), aborts and preemptions, every
block is accounted for, and once everything ends every block and slot is free again.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.config import EngineConfig
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

BLOCK = 4


def _check_invariants(sched: Scheduler, pool: BlockPool, num_slots: int) -> None:
    refs = [0] * pool.num_blocks
    for req in sched.running:
        assert req.status is Status.RUNNING and req.slot is not None
        assert len(req.block_ids) * BLOCK >= req.num_computed_tokens
        for b in req.block_ids:
            refs[b] += 1
    for req in sched.waiting:
        assert req.slot is None and not req.block_ids and req.num_computed_tokens == 0
    assert refs == pool.ref_count
    free = set(pool._free)
    assert all((pool.ref_count[b] == 0) == (b in free) for b in range(pool.num_blocks))
    slots = [r.slot for r in sched.running] + sched.free_slots
    assert sorted(slots) == list(range(num_slots))


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.integers(1, 64), prefix=st.booleans())
def test_random_workloads_keep_blocks_accounted(ops, num_blocks, budget, prefix):
    num_slots = 6
    config = EngineConfig(max_num_seqs=num_slots, max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    pool = BlockPool(num_blocks)
    sched = Scheduler(config, pool, BLOCK, num_slots)
    requests: list[Request] = []
    shared = list(range(100, 124))  # prompts may share this prefix
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, share = op
            if (length + max_tokens) / BLOCK > num_blocks - 1:
                continue  # the engine rejects requests that could never fit
            prompt = (shared[: share * 6] + list(range(length)))[: max(length, 1)]
            req = Request(str(len(requests)), None, prompt, SamplingParams(max_tokens=max_tokens), None, 0.0)
            requests.append(req)
            sched.add(req)
        elif op[0] == "step":
            rng = torch.Generator().manual_seed(op[1])
            for chunk in sched.schedule():
                req = chunk.request
                if chunk.samples and req.status is Status.RUNNING:
                    req.output_token_ids.append(int(torch.randint(0, 50, (1,), generator=rng)))
                    done = len(req.output_token_ids) >= req.params.max_tokens
                    if done or torch.rand(1, generator=rng).item() < 0.1:
                        sched.finish(req)
                if req.status is Status.RUNNING:
                    sched.publish_full_blocks(req)
        elif requests:
            req = requests[op[1] % len(requests)]
            if req.status is not Status.FINISHED:
                sched.finish(req)
        _check_invariants(sched, pool, num_slots)
    # drain: every request finishes eventually, then everything is free again
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        for chunk in sched.schedule():
            req = chunk.request
            if chunk.samples and req.status is Status.RUNNING:
                req.output_token_ids.append(1)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req)
            if req.status is Status.RUNNING:
                sched.publish_full_blocks(req)
        _check_invariants(sched, pool, num_slots)
    assert sched.num_unfinished == 0
    assert pool.num_free == num_blocks and not any(pool.ref_count)
    assert sorted(sched.free_slots) == list(range(num_slots))


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 30), data=st.data())
def test_blocks_that_cache_nothing_are_reused_first(num_blocks, data):
    """A freed block without a hash is handed out again before any other free block (its pages
    are mapped and warm), and a hashed one only after every block that caches nothing, least
    recently freed first, so cached prefixes live longest."""
    pool = BlockPool(num_blocks)
    taken = pool.allocate(num_blocks)
    assert taken is not None
    hashed = data.draw(st.lists(st.sampled_from(taken), unique=True, max_size=num_blocks))
    for i, block in enumerate(hashed):
        pool.cache(block, b"h%d" % i)
    order = data.draw(st.permutations(taken))
    pool.free(order)
    plain_freed = [b for b in order if b not in hashed]
    again = pool.allocate(num_blocks)
    assert again is not None
    # unhashed: the last freed first; then the hashed blocks in the order they were freed
    assert again == plain_freed[::-1] + [b for b in order if b in hashed]
    assert all(pool.lookup([b"h%d" % i]) == [] for i in range(len(hashed)))  # evicted on reuse
