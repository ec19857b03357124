"""Throughput cost of ``batch_invariant=True`` on SmolLM2-135M (CPU): the same 32 requests
(random prompts of 32-96 tokens, 64 sampled tokens each, seeded, ``ignore_eos``) with the
default engine and with batch invariance, best of three runs each.

    python benchmarks/batch_invariant.py [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import time

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 40000) for _ in range(rng.randrange(32, 97))] for _ in range(args.requests)]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(args.requests)
    ]
    tokens = args.requests * args.max_tokens
    rates = {}
    for invariant in (False, True):
        llm = LLM(
            "smollm2-135m",
            batch_invariant=invariant,
            max_num_seqs=args.requests,
            enable_prefix_caching=False,
        )
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        rates[invariant] = tokens / best
        print(
            f"batch_invariant={invariant}: {rates[invariant]:.1f} out tok/s ({best:.2f} s, {tokens} tokens)"
        )
    print(f"ratio invariant / default: {rates[True] / rates[False]:.3f}")


if __name__ == "__main__":
    main()
