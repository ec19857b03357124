"""A prefill/decode pair on DeepSeek V4 and V4.1 (their hybrid caches: compressed entries,
indexer keys, compressor snapshots, window rows, V4.1's Engram ids travel in each block):
the decode engine's greedy tokens equal one engine's alone, on generated workloads."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import ServeProcess

from deepinfer import LLM, SamplingParams
from deepinfer.disagg.roles import KVRoles

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Three prompts of 20-70 tokens; two share an opening (a hit on both sides)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(rng.randrange(16, 40))]
    return [
        shared + [rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))],
        [rng.randrange(3, 200) for _ in range(rng.randrange(20, 70))],
        shared + [rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))],
    ]


@pytest.fixture(scope="module", params=["v4_short_ckpt", "v41_ckpt"])
def pair(request):
    ckpt = str(request.getfixturevalue(request.param))
    server = ServeProcess(ckpt, "--kv-role", "prefill", "--max-model-len", "256")
    alone = LLM(ckpt, max_model_len=256)
    decode = LLM(ckpt, max_model_len=256, kv_role="decode")
    roles = KVRoles.decode(decode.engine.tiers, decode.engine.config.block_size, server.url, 30.0)
    yield alone, decode, roles
    roles.close()
    server.terminate()


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_the_decode_engine_answers_what_one_engine_answers(pair, seed):
    alone, decode, roles = pair
    prompts = _prompts(seed)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, PARAMS, use_tqdm=False)]
    before = decode.engine.tiers.stats().hit_blocks["remote"]
    got = []
    for prompt in prompts:  # as a server queues them: the peer prefills, then this engine decodes
        asyncio.run(roles.before_queueing([prompt], None))
        got.append(decode.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == expected
    assert decode.engine.tiers.stats().hit_blocks["remote"] > before, "no block came from the peer"
    engine = decode.engine
    assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"
