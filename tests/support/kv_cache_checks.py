"""Shared by the quantized K/V cache tests (fp8, int8): a greedy run with its logprobs, call
counters proving the CPU kernels ran on the pools, and an fp32-cache twin whose writes are
rounded by a given function on the Python write path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from deepinfer.kernels import kv_rotation
from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import rope_store as cpu_rope_store

from deepinfer import LLM, SamplingParams
from deepinfer.cache import kv_dtypes

Run = list[tuple[list[int], list[float]]]


def greedy_logprobs(llm: LLM, prompts: list[list[int]]) -> Run:
    """Six greedy tokens per prompt and each one's logprob."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        )
        for o in outs
    ]


def count_kernel_calls(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the one-call decode stack's and the in-place decode attention's calls, filled
    as ``llm`` runs (until ``monkeypatch.undo()``)."""
    calls = {"stack": 0, "attention": 0}
    stack, attention = type(llm.engine.runner.forward.stack), cpu_attention.decode_attention
    real_stack = stack.__call__

    def counted_stack(self, *args):
        calls["stack"] += 1
        return real_stack(self, *args)

    def counted_attention(*args):
        calls["attention"] += 1
        return attention(*args)

    monkeypatch.setattr(stack, "__call__", counted_stack)
    monkeypatch.setattr(cpu_attention, "decode_attention", counted_attention)
    return calls


def rounded_twin(
    path,
    monkeypatch: pytest.MonkeyPatch,
    round_rows: Callable[[torch.Tensor], torch.Tensor] | None,
    rotated: bool = False,
) -> LLM:
    """An fp32-cache engine on the layer path whose cache writes go through ``round_rows`` on
    the Python write path (None: unrounded); with ``rotated`` its queries and keys meet in the
    int8 cache's Hadamard basis, as the int8 cache's do."""
    twin = LLM(path, kv_cache_dtype="float32", enable_prefix_caching=False)
    if hasattr(twin.engine.runner.forward, "stack"):  # the one-call Llama stack: off
        twin.engine.runner.forward.stack = None
    if rotated:
        monkeypatch.setattr(kv_rotation, "rotates", lambda dtype: True)
        monkeypatch.setattr(cpu_rope_store, "supports", lambda *a: False)  # rotates on the Python path
    if round_rows is not None:
        real = kv_dtypes.store

        def rounded(pool, rows, values, functional=False):
            return real(pool, rows, round_rows(values), functional)

        monkeypatch.setattr(kv_dtypes, "store", rounded)
        monkeypatch.setattr(cpu_rope_store, "supports", lambda *a: False)  # writes through kv_dtypes
    return twin


def close(got: Run, want: Run, atol: float) -> bool:
    """Same tokens, logprobs within ``atol``."""
    return all(
        tokens == ref_tokens and max(abs(a - b) for a, b in zip(lp, ref_lp, strict=True)) <= atol
        for (tokens, lp), (ref_tokens, ref_lp) in zip(got, want, strict=True)
    )
