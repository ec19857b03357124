"""V4.1's optional causal encoder/decoder prefill (``ced_split``): the decoder layers run
only over each prompt's last window; exact when the prompt fits in the window, approximate
(and measured) beyond it, and still invariant to batching, chunking and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cache import kv_formats
from deepinfer.cache.kv_formats import PackedRows
from deepinfer.cache.session import Session
from deepinfer.models.loading import load_model


@pytest.fixture(scope="module")
def model(v41_ckpt):
    return load_model(v41_ckpt)


# the largest |d logprob| CED may cost the tiny V4.1 over a prefill and four decodes (measured
# below 0.12 over checkpoint seeds 0-2; a decoder window of half the sliding window costs 0.4-5)
CED_DRIFT_BOUND = 0.25


def _prefill_then_decode(
    model, prompt: torch.Tensor, steps: int, ced: bool, window: int | None = None
) -> torch.Tensor:
    """Last-prompt-token logits, then ``steps`` greedy decode logits [B, 1 + steps, V];
    ``window``: the decoder's rows under CED (default: the sliding window, as specified)."""
    window = window or model.config.sliding_window
    session = Session(model, prompt.shape[0], prompt.shape[1] + steps)
    replay_from = max(0, prompt.shape[1] - window) if ced else 0
    out = [session.feed(prompt, replay_from=replay_from, last_logits_only=True)]
    for _ in range(steps):
        out.append(session.feed(out[-1].argmax(-1), replay_from=replay_from))
    return torch.cat(out, dim=1)


def test_decoder_runs_only_the_last_window_and_logits_move_a_little(model):
    split = model.ced_split
    assert split == 4  # the first ratio-1 layer of the tiny config
    rows_seen: list[int] = []
    hook = model.layers[split + 1].register_forward_pre_hook(
        lambda m, args: rows_seen.append(args[0].shape[0])
    )
    try:
        prompt = torch.randint(0, 258, (2, 60), generator=torch.Generator().manual_seed(1))
        exact = _prefill_then_decode(model, prompt, 4, ced=False)
        rows_seen.clear()
        ced = _prefill_then_decode(model, prompt, 4, ced=True)
    finally:
        hook.remove()
    assert rows_seen[0] == 2 * model.config.sliding_window  # prefill: 2 sequences x last window
    drift = (exact.log_softmax(-1) - ced.log_softmax(-1)).abs().amax(dim=(0, 2))
    print("max |d logprob| per step (prefill, then decodes):", [f"{d:.3g}" for d in drift.tolist()])
    assert drift[0] > 1e-4  # the approximation is active ...
    assert drift.max() < CED_DRIFT_BOUND  # ... and costs little
    assert torch.isfinite(ced).all()


def test_the_drift_bound_sees_a_decoder_window_too_short(model):
    """Mutation check: the decoder run over half the sliding window drifts past the bound."""
    prompt = torch.randint(0, 258, (2, 60), generator=torch.Generator().manual_seed(1))
    exact = _prefill_then_decode(model, prompt, 4, ced=False)
    short = _prefill_then_decode(model, prompt, 4, ced=True, window=model.config.sliding_window // 2)
    assert (exact.log_softmax(-1) - short.log_softmax(-1)).abs().max() > CED_DRIFT_BOUND


def test_engine_outputs_are_batch_and_chunk_invariant_under_ced(v41_ckpt):
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 258) for _ in range(rng.randrange(1, 120))] for _ in range(16)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(v41_ckpt, ced_prefill=True, enable_prefix_caching=False, max_num_batched_tokens=512)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    tight = LLM(
        v41_ckpt,
        ced_prefill=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=40,
        num_cache_blocks=20,
    )
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert together == alone


def test_short_prompts_stay_exact_beside_ced_prompts_and_stale_rows_do_not_leak(v41_ckpt):
    """Prompts within the window are exact under CED even when they share steps with long
    prompts whose decoder rows are narrowed; and rows CED never writes hold earlier owners'
    data (here: finite garbage) that must not reach any output."""
    rng = random.Random(7)
    short = [[rng.randrange(2, 258) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    long = [[rng.randrange(2, 258) for _ in range(rng.randrange(20, 90))] for _ in range(6)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    exact = LLM(v41_ckpt, enable_prefix_caching=False)
    expected_short = [exact.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in short]
    ced = LLM(v41_ckpt, ced_prefill=True, enable_prefix_caching=False)
    expected_long = [ced.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in long]
    dirty = LLM(v41_ckpt, ced_prefill=True, enable_prefix_caching=False, max_num_batched_tokens=48)
    gen = torch.Generator().manual_seed(0)
    for pools in dirty.engine.runner.pools:
        garbage = torch.randn(pools.window.shape, generator=gen) * 1e4
        if isinstance(pools.window, PackedRows):  # the trained-precision cache: encode it
            pools.window.data.copy_(kv_formats.encode(pools.window.fmt, garbage))
        else:
            pools.window.copy_(garbage)
    outs = [o.outputs[0].token_ids for o in dirty.generate(short + long, params, use_tqdm=False)]
    assert outs == expected_short + expected_long


def test_ced_needs_prefix_caching_off_and_a_v41_model(v41_ckpt, v4_ckpt):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(v41_ckpt, ced_prefill=True)
    with pytest.raises(ValueError, match="ced_prefill"):
        LLM(v4_ckpt, ced_prefill=True, enable_prefix_caching=False)
