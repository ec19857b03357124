"""A prefill/decode pair on tiny Llama, DeepSeek V4 and V4.1 (their hybrid caches: compressed
entries, indexer keys, compressor snapshots, window rows, V4.1's Engram ids travel in each
block): the decode engine's greedy tokens equal one engine's alone, on generated workloads
with chunked prefill, preemption and prefix hits on both sides."""

from __future__ import annotations

import asyncio
import random

import pytest
from equivalence_workloads import count_preemptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import ServeProcess

from deepinfer import LLM, SamplingParams
from deepinfer.disagg.roles import KVRoles
from deepinfer.tiny import make_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Three prompts of 20-70 tokens; two share an opening (a hit on both sides)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(rng.randrange(16, 40))]
    return [
        shared + [rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))],
        [rng.randrange(3, 200) for _ in range(rng.randrange(20, 70))],
        shared + [rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))],
    ]


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disagg_llama"), arch="llama", seed=5)


@pytest.fixture(scope="module", params=["llama_ckpt", "v4_short_ckpt", "v41_ckpt"])
def pair(request):
    ckpt = str(request.getfixturevalue(request.param))
    server = ServeProcess(ckpt, "--kv-role", "prefill", "--max-model-len", "256")
    alone = LLM(ckpt, max_model_len=256)
    yield ckpt, server, alone
    server.terminate()


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([32, 48]), blocks=st.sampled_from([7, 64]))
def test_the_decode_engine_answers_what_one_engine_answers(pair, seed, chunk, blocks):
    """The decode engine with drawn prefill chunks and pool sizes (7 blocks preempt); the
    prompts' shared opening gives prefix hits on both sides."""
    ckpt, server, alone = pair
    decode = LLM(
        ckpt, max_model_len=256, kv_role="decode", max_num_batched_tokens=chunk, num_cache_blocks=blocks
    )
    roles = KVRoles.decode(decode.engine.tiers, decode.engine.config.block_size, server.url, 30.0)
    preempted = count_preemptions(decode)
    try:
        prompts = _prompts(seed)
        expected = [o.outputs[0].token_ids for o in alone.generate(prompts, PARAMS, use_tqdm=False)]
        for prompt in prompts:  # the peer prefills each, then this engine takes the blocks
            asyncio.run(roles.before_queueing([prompt], None))
        got = [o.outputs[0].token_ids for o in decode.generate(prompts, PARAMS, use_tqdm=False)]
        assert got == expected
        assert decode.engine.tiers.stats().hit_blocks["remote"] > 0, "no block came from the peer"
        assert preempted or blocks > 7, "the small pool preempted nothing"
        engine = decode.engine
        assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"
    finally:
        roles.close()
        decode.close()
