"""Shared by the tensor- and data-parallel tests: a mixed workload (a shared prefix on every
third prompt, random lengths, greedy with logprobs) and the comparison with one process."""

from __future__ import annotations

import random

from deepinfer import SamplingParams


def workload(seed: int, n: int = 10, shared_len: int = 40):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 258) for _ in range(shared_len)]
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(2, 258) for _ in range(rng.randrange(1, 70))]
        for i in range(n)
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True, logprobs=1)
        for _ in prompts
    ]
    return prompts, params


def tokens_and_logprobs(outs):
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
        )
        for o in outs
    ]


def assert_same(got, expected) -> None:
    """Greedy tokens equal; their logprobs within 1e-4."""
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert all(abs(a - b) <= 1e-4 for a, b in zip(logprobs, want_logprobs, strict=True))


def routed_expert_bytes(moe) -> int:
    """The bytes of a MoE layer's routed experts as it holds them (stacked, or fp4)."""
    names = ("w1_fp4", "w2_fp4", "w3_fp4") if moe.holds_fp4 else ("w1_stacked", "w2_stacked", "w3_stacked")
    return sum(
        getattr(moe, n).numel() * getattr(moe, n).element_size() for n in names if getattr(moe, n) is not None
    )
