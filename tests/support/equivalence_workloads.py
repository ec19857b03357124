"""Random greedy workloads and the "alone" reference that engine-equivalence tests share."""

from __future__ import annotations

import random

from deepinfer import LLM, SamplingParams

NUM_REQUESTS = 200


def workload(
    seed: int, vocab: int, shared_prefixes: bool, num_requests: int = NUM_REQUESTS
) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, vocab) for _ in range(rng.randrange(130, 270))] for _ in range(4)]
    work = []
    for i in range(num_requests):
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


def alone_runner(ckpt, num_requests: int = NUM_REQUESTS, **engine_kwargs):
    """Reference: every request alone, synchronous, no prefix cache, one chunk per prompt."""
    llm = LLM(
        ckpt, async_scheduling=False, enable_prefix_caching=False, max_num_batched_tokens=512, **engine_kwargs
    )
    cache: dict[int, list[list[int]]] = {}

    def run(seed: int, shared: bool) -> list[list[int]]:
        key = seed * 2 + shared
        if key not in cache:
            cache[key] = [
                llm.generate([p], q)[0].outputs[0].token_ids
                for p, q in workload(seed, llm.vocab_size, shared, num_requests)
            ]
        return cache[key]

    return run


def together(llm: LLM, seed: int, shared: bool, num_requests: int = NUM_REQUESTS) -> list[list[int]]:
    """Run the whole workload in one generate call; check nothing leaked."""
    work = workload(seed, llm.vocab_size, shared, num_requests)
    outs = llm.generate([p for p, _ in work], [q for _, q in work])
    engine = llm.engine
    assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))
    return [o.outputs[0].token_ids for o in outs]


def count_preemptions(llm: LLM) -> list[str]:
    """Wrap the engine's scheduler so every preemption is recorded: returns the list the
    preempted request ids are appended to as they happen."""
    scheduler = llm.engine.scheduler
    preempted: list[str] = []
    preempt = scheduler.preempt

    def counting(request) -> None:
        preempted.append(request.request_id)
        preempt(request)

    scheduler.preempt = counting
    return preempted
