"""A prefill server and a decode server (``deepinfer.disagg``): the decode server has its peer
prefill each prompt, takes the prompt's blocks over the transfer channel, and answers what one
server answers alone; a dead, stalled or corrupting peer leaves it computing the prompt itself."""

from __future__ import annotations

import os
import random
import signal

import openai
import pytest
from live_server import LiveServer, ServeProcess

from deepinfer import LLM, SamplingParams
from deepinfer.disagg import transfer
from deepinfer.disagg.handover import PrefillClient
from deepinfer.disagg.roles import KVRoles
from deepinfer.server.app import build_app

MODEL = "smollm2-135m"
WORDS = "river stone cloud garden lamp orbit violin market winter copper forest signal harbor".split()
MAX_TOKENS = 8
ENGINE = {"max_model_len": 512}


def _prompts(seed: int, count: int) -> list[str]:
    """``count`` prompts of 40-120 words; half open with one shared passage (prefix hits on
    both sides)."""
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(60))
    out = []
    for i in range(count):
        own = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(40, 120)))
        out.append(f"{shared} {own}" if i % 2 == 0 else own)
    return out


@pytest.fixture(scope="module")
def expected() -> dict[int, list[str]]:
    """One server's greedy replies, alone."""
    llm = LLM(MODEL, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    out = {
        seed: [o.outputs[0].text for o in llm.generate(_prompts(seed, 4), params, use_tqdm=False)]
        for seed in (1, 2)
    }
    llm.close()
    return out


@pytest.fixture(scope="module")
def prefill_server():
    server = ServeProcess(MODEL, "--kv-role", "prefill", "--max-model-len", "512")
    yield server
    server.terminate()


def _decode_server(peer: str | None, timeout_s: float = 30.0) -> tuple[LiveServer, LLM, KVRoles]:
    llm = LLM(MODEL, kv_role="decode", **ENGINE)
    made: list[KVRoles] = []

    def roles(llm_: LLM) -> KVRoles:
        made.append(KVRoles.decode(llm_.engine.tiers, llm_.engine.config.block_size, peer, timeout_s))
        return made[0]

    live = LiveServer(build_app(llm, "smol", kv_roles=roles))
    return live, llm, made[0]


def _replies(live: LiveServer, prompts: list[str]) -> list[str]:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)
    return [
        client.completions.create(model="smol", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
        .choices[0]
        .text
        for p in prompts
    ]


def _check_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_pools[0].num_free == engine.num_blocks, "blocks leaked"


def test_a_pair_answers_what_one_server_answers(prefill_server, expected):
    live, llm, roles = _decode_server(prefill_server.url)
    try:
        for seed in (1, 2):  # the second round also finds the shared passage on both sides
            assert _replies(live, _prompts(seed, 4)) == expected[seed]
        stats = llm.engine.tiers.stats()
        assert stats.hit_blocks["remote"] > 0, "no block came from the prefill server"
        # the second round's shared passage came from this server's own pool, not the peer's
        assert llm.engine.block_pools[0].hit_blocks > 0
        assert roles.client is not None and roles.client.failed == 0
        assert roles.client.remote.stats.failed == roles.client.remote.stats.corrupt == 0
        _check_no_leak(llm)
    finally:
        live.stop()
        llm.close()


@pytest.mark.parametrize("fault", ["corrupt", "stalled"])
def test_a_bad_transfer_is_refused_and_the_prompt_computed_here(prefill_server, expected, fault, monkeypatch):
    """``corrupt``: the rows fail their checksum (the receiver's digest disagrees);
    ``stalled``: the prefill server stops after answering the prefill, and the transfer times
    out. Either way the decode server computes the prompt and answers the same."""
    live, llm, roles = _decode_server(prefill_server.url, timeout_s=30.0 if fault == "corrupt" else 3.0)
    stopped = []
    if fault == "corrupt":
        real = transfer.digest  # the prefill server's own process computes the true digest
        monkeypatch.setattr(transfer, "digest", lambda rows: real(rows).flip(0))
    else:
        prefill = PrefillClient.prefill

        async def then_stop(self, ids, salt):
            ok = await prefill(self, ids, salt)
            os.kill(prefill_server.proc.pid, signal.SIGSTOP)
            stopped.append(True)
            return ok

        monkeypatch.setattr(PrefillClient, "prefill", then_stop)
    try:
        assert _replies(live, _prompts(1, 1)) == expected[1][:1]
        stats = roles.client.remote.stats
        assert (stats.corrupt if fault == "corrupt" else stats.failed) > 0
        assert llm.engine.tiers.stats().failed_loads > 0
        _check_no_leak(llm)
    finally:
        if stopped:
            os.kill(prefill_server.proc.pid, signal.SIGCONT)
        live.stop()
        llm.close()


def test_a_dead_prefill_server_leaves_the_decode_server_serving(expected):
    server = ServeProcess(MODEL, "--kv-role", "prefill", "--max-model-len", "512")
    live, llm, roles = _decode_server(server.url, timeout_s=5.0)
    try:
        server.proc.kill()
        server.proc.wait(timeout=30)
        assert _replies(live, _prompts(2, 2)) == expected[2][:2]
        assert roles.client is not None and roles.client.failed == 2
        _check_no_leak(llm)
    finally:
        live.stop()
        llm.close()


def test_a_proxy_drives_the_pair_with_kv_transfer_params(prefill_server, expected):
    """vLLM's proxy form: the proxy sends the prompt to the prefill server with
    ``do_remote_decode``, then to the decode server (no peer of its own) with the answer's
    ``kv_transfer_params``. Malformed params leave the decode server computing the prompt."""
    live, llm, roles = _decode_server(None)
    prefill = openai.OpenAI(base_url=f"{prefill_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    decode = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        got = []
        prompts = _prompts(1, 4)
        for i, prompt in enumerate(prompts):
            answer = prefill.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=1,
                temperature=0.0,
                extra_body={"kv_transfer_params": {"do_remote_decode": True}},
            )
            params = answer.model_extra["kv_transfer_params"]
            assert params["do_remote_prefill"] and params["block_hashes"]
            if i == 3:
                params = {"do_remote_prefill": True, "block_hashes": "not hex"}
            reply = decode.completions.create(
                model="smol",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"kv_transfer_params": params},
            )
            got.append(reply.choices[0].text)
        assert got == expected[1]
        assert llm.engine.tiers.stats().hit_blocks["remote"] > 0
        _check_no_leak(llm)
    finally:
        live.stop()
        llm.close()
