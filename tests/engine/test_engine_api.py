"""Engine features a user touches: abort, bad input while serving, stop strings, min_tokens,
logit_bias, penalties, n > 1, prompt logprobs, metrics, progress."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams, load_model


@pytest.fixture(scope="module")
def llm(v4_ckpt) -> LLM:
    return LLM(v4_ckpt, max_num_seqs=8)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_abort_frees_everything_and_spares_the_others(llm):
    engine = llm.engine
    alone = llm.generate([[7, 8, 9]], _greedy(12))[0].outputs[0].token_ids
    keep = engine.add_request("keep", [7, 8, 9], _greedy(12))
    drop = engine.add_request("drop", list(range(2, 60)), _greedy(30))
    for _ in range(3):
        engine.step()
    engine.abort("drop")
    while engine.has_unfinished():
        engine.step()
    assert drop.finish_reason == "abort" and keep.output_token_ids == alone
    assert engine.block_pools[0].num_free == engine.num_blocks
    engine.pop_finished("keep"), engine.pop_finished("drop")


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], None, "prompt_token_ids"),
        ([1, 9999], None, "9999"),
        ([1] * 5000, None, "max_model_len"),
        ([1, 2], {"logit_bias": {99999: 1.0}}, "logit_bias"),
        ([1, 2], {"logprobs": 10**6}, "max_logprobs"),  # the whole vocabulary per token: refused
        ([1, 2], {"prompt_logprobs": 21}, "max_logprobs"),
    ],
)
def test_bad_requests_fail_alone_while_others_keep_going(llm, prompt, params, field):
    engine = llm.engine
    alone = llm.generate([[3, 4, 5]], _greedy(10))[0].outputs[0].token_ids
    good = engine.add_request("good", [3, 4, 5], _greedy(10))
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**(params or {})))
    while engine.has_unfinished():
        engine.step()
    assert good.output_token_ids == alone and "bad" not in engine.requests
    engine.pop_finished("good")
    assert engine.block_pools[0].num_free == engine.num_blocks


@pytest.mark.parametrize(
    "kwargs,field",
    [({"max_tokens": 0}, "max_tokens"), ({"top_p": 1.5}, "top_p"), ({"temperatur": 1.0}, "temperatur")],
)
def test_bad_sampling_params_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_engine_option_is_named(v4_ckpt):
    with pytest.raises(ValueError, match="max_num_seq\\b|max_num_seq,|max_num_seq;"):
        LLM(v4_ckpt, max_num_seq=4)


def test_generate_rejects_the_whole_call_on_one_bad_prompt(llm):
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate([[1, 2], [3, 4], [5, 999]], _greedy(3))
    assert not llm.engine.requests and llm.engine.block_pools[0].num_free == llm.engine.num_blocks


def test_stop_strings_truncate_text(llm):
    prompt = "Once upon a time"
    free = llm.generate(prompt, _greedy(24))[0].outputs[0]
    at = next(i for i in range(3, len(free.text) - 2) if free.text.find(free.text[i : i + 2]) == i)
    stop = free.text[at : at + 2]
    out = llm.generate(prompt, _greedy(24, stop=[stop, "never-there"]))[0].outputs[0]
    assert out.text == free.text[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(prompt, _greedy(24, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: at + 2]


def test_min_tokens_blocks_eos_and_logit_bias_forces_tokens(llm):
    eos = llm.eos_token_ids[0]
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    assert llm.generate([5, 6], forced)[0].outputs[0].token_ids == [eos]
    at_least = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4)
    out = llm.generate([5, 6], at_least)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    biased = llm.generate([5, 6], _greedy(6, logit_bias={42: 100.0}))[0].outputs[0]
    assert biased.token_ids == [42] * 6


def test_penalties_change_greedy_choices(llm):
    base = llm.generate([5, 6, 7], _greedy(40))[0].outputs[0].token_ids
    assert len(set(base)) < len(base), "need a repeating greedy output for this test"
    penalised = llm.generate([5, 6, 7], _greedy(40, frequency_penalty=2.0, presence_penalty=2.0))[0]
    tokens = penalised.outputs[0].token_ids
    assert tokens != base and len(set(tokens)) >= len(set(base))


def test_n_siblings(llm):
    out = llm.generate(
        [9, 9, 9], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    again = llm.generate(
        [9, 9, 9], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    )[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate([9, 9, 9], SamplingParams(n=2, max_tokens=6, temperature=0.0))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_prompt_logprobs_match_the_model(v4_ckpt, llm):
    prompt = [3, 17, 200, 45, 9, 77, 120, 5, 66, 31, 90]
    out = llm.generate(prompt, _greedy(2, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = load_model(v4_ckpt)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert len(entry) in (2, 3)


def test_prompt_logprobs_survive_chunked_prefill(v4_ckpt):
    small = LLM(v4_ckpt, max_num_batched_tokens=5, async_scheduling=False)
    big = LLM(v4_ckpt)
    prompt = list(range(10, 40))
    a = small.generate(prompt, _greedy(2, prompt_logprobs=0))[0].prompt_logprobs
    b = big.generate(prompt, _greedy(2, prompt_logprobs=0))[0].prompt_logprobs
    assert len(a) == len(b) == len(prompt)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


def test_metrics_are_filled(llm):
    out = llm.generate([1, 2, 3], _greedy(5))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft > 0 and m.tpot > 0 and m.num_generated_tokens == 5


def _logprobs_of(llm: LLM, prompt: list[int]) -> list[tuple[int, float]]:
    """Every (token, logprob) the engine reports: the prompt's top 3 per position, then each
    greedy token's top 3."""
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=3, logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    return [(t, entry[t].logprob) for entry in entries for t in sorted(entry)]


def _worst(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> float:
    """The largest logprob difference, infinite where the reported tokens differ."""
    if [t for t, _ in got] != [t for t, _ in want]:
        return float("inf")
    return max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True))


@pytest.mark.parametrize("arch", ["deepseek_v4", "llama"])
def test_kv_cache_dtype_halves_the_cache_and_keeps_the_logits(arch, tmp_path, monkeypatch):
    """kv_cache_dtype="bfloat16" on an fp32 model: bf16 pools (compressor state stays fp32),
    about half the bytes per block, and the prompt's and the greedy tokens' logprobs of an fp32
    cache whose every write is rounded through bf16 (on the Python write path) within 1e-4;
    an unknown dtype is a clear error. Mutation check: the fp32 cache without the rounding,
    or rounding through fp16 instead, is caught."""
    from deepinfer.kernels.cpu import rope_store as cpu_rope_store

    from deepinfer.cache import kv_dtypes
    from deepinfer.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=2)
    prompt = [5, 9, 33, 70, 12, 8, 200, 41, 3, 19, 77, 31]
    half = LLM(path, kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    assert all(p.window.dtype == torch.bfloat16 for p in half.engine.runner.pools)
    for p in half.engine.runner.pools:
        if p.compressor is not None:
            assert p.compressor.buf_kv.dtype == torch.float32
    layout = half.engine.layout

    def per_block(dtype):  # a block's entries and snapshots plus a block of window rows
        return layout.block_bytes(dtype) + layout.window_block_bytes(dtype)

    ratio = per_block(torch.bfloat16) / per_block(torch.float32)
    assert 0.45 <= ratio <= 0.6
    got = _logprobs_of(half, prompt)
    twin = LLM(path, kv_cache_dtype="float32", enable_prefix_caching=False)
    if arch == "llama":  # the layer path, whose writes go through kv_dtypes.store
        twin.engine.runner.forward.stack = None
    monkeypatch.setattr(cpu_rope_store, "supports", lambda *a: False)  # writes through kv_dtypes
    real = kv_dtypes.store

    def twin_through(dtype: torch.dtype | None) -> list[tuple[int, float]]:
        def rounded(pool, rows, values, functional=False):
            return real(pool, rows, values.to(dtype).float(), functional)

        monkeypatch.setattr(kv_dtypes, "store", real if dtype is None else rounded)
        return _logprobs_of(twin, prompt)

    assert _worst(got, twin_through(torch.bfloat16)) <= 1e-4
    assert _worst(got, twin_through(None)) > 1e-3  # the mutations: no rounding ...
    assert _worst(got, twin_through(torch.float16)) > 1e-3  # ... or fp16's
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(path, kv_cache_dtype="fp4")


def test_prefix_cache_is_shared_only_under_the_same_salt(llm):
    """Block hashes are SHA-256 chained from the request's ``cache_salt``: a repeated prompt
    hits the cache under its own salt and misses under another (no cross-tenant sharing or
    timing probe)."""
    engine = llm.engine
    prompt = [(5 + i) % 200 for i in range(3 * engine.layout.block_size + 3)]

    def cached(rid: str, salt: str | None) -> int:
        req = engine.add_request(rid, prompt, _greedy(2), cache_salt=salt)
        while not req.finished:
            engine.step()
        engine.pop_finished(rid)
        return req.num_cached_tokens

    assert cached("salt-a1", "tenant-a") == 0
    assert cached("salt-a2", "tenant-a") == 3 * engine.layout.block_size
    assert cached("salt-b1", "tenant-b") == 0
    assert cached("salt-none", None) == 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("salt-bad", prompt, _greedy(2), cache_salt="")


def test_cpu_malloc_tuning_is_applied_once_and_can_be_refused(v4_ckpt, monkeypatch):
    """The CPU engine sets glibc's allocation thresholds at start (``tune_cpu_malloc``,
    default on) and leaves them alone when told; a non-bool is named."""
    import deepinfer.engine.setup as engine_setup
    from deepinfer.platforms.cpu import tune_malloc

    assert tune_malloc() is True  # glibc here: mallopt took both settings
    calls: list[int] = []
    monkeypatch.setattr(engine_setup, "tune_malloc", lambda: calls.append(1))
    LLM(str(v4_ckpt), tune_cpu_malloc=False, num_cache_blocks=16)
    assert calls == []
    LLM(str(v4_ckpt), num_cache_blocks=16)
    assert calls == [1]
    with pytest.raises(ValueError, match="tune_cpu_malloc"):
        LLM(str(v4_ckpt), tune_cpu_malloc="yes")


@pytest.mark.parametrize("raw", ["0.5", "2", "1e-3"])
def test_kv_cache_space_env_sizes_the_cache_when_no_budget_is_given(raw, monkeypatch):
    from deepinfer.config import KV_CACHE_SPACE_ENV, EngineConfig

    monkeypatch.setenv(KV_CACHE_SPACE_ENV, raw)
    assert EngineConfig().kv_cache_memory_bytes == int(float(raw) * (1 << 30))
    assert EngineConfig(kv_cache_memory_bytes=4096).kv_cache_memory_bytes == 4096  # explicit wins
    monkeypatch.delenv(KV_CACHE_SPACE_ENV)
    assert EngineConfig().kv_cache_memory_bytes is None  # then: a fraction of free memory


@pytest.mark.parametrize("raw", ["lots", "0", "-1", "nan", "inf"])
def test_a_bad_kv_cache_space_env_is_named(raw, monkeypatch):
    from deepinfer.config import KV_CACHE_SPACE_ENV, EngineConfig

    monkeypatch.setenv(KV_CACHE_SPACE_ENV, raw)
    with pytest.raises(ValueError, match=f"DEEPINFER_KV_CACHE_SPACE_GB.*{raw}"):
        EngineConfig()
