"""Cost of structured outputs on SmolLM2-135M (CPU): the token mask per constrained row per
step, and output throughput with and without grammars.

    python benchmarks/structured_outputs.py [--requests 32] [--max-tokens 96]

Mask cost: every constrained output is replayed through a fresh xgrammar matcher, timing
``fill_next_token_bitmask`` at each step (one row), then applying a filled bitmask to a
batch of logits (``apply_token_bitmask_inplace``), per row. Throughput: the same prompts
generated in one batch, each way three times (best kept), constrained by a JSON schema (``disable_any_whitespace``) and
unconstrained with ``ignore_eos`` to the same output lengths the constrained run produced,
so both compute the same number of tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    llm = LLM("smollm2-135m", max_num_seqs=args.requests, max_model_len=512)
    prompts = [f"Person {i} as JSON: " for i in range(args.requests)]
    constrained = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=i,
            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
        )
        for i in range(args.requests)
    ]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up, grammar compiled and cached
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)
    ]

    def best_of(params: list[SamplingParams], repeats: int = 3) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    without = best_of(free)
    with_grammar = best_of(constrained)

    backend = llm.engine.structured.backend
    assert backend is not None
    compiled = backend.compile(constrained[0].structured_outputs)
    fills = []
    for o in outs:
        matcher = backend.xgr.GrammarMatcher(compiled)
        bitmask = backend.xgr.allocate_token_bitmask(1, backend.vocab_size)
        for token in o.outputs[0].token_ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            fills.append(time.perf_counter() - t)
            matcher.accept_token(token)
    logits = torch.randn(args.requests, backend.vocab_size)
    full = backend.xgr.allocate_token_bitmask(args.requests, backend.vocab_size)
    applies = []
    for _ in range(50):
        t = time.perf_counter()
        backend.xgr.apply_token_bitmask_inplace(logits, full, vocab_size=backend.vocab_size)
        applies.append(time.perf_counter() - t)
    tokens = sum(lengths)
    print(
        f"requests {args.requests}, output tokens {tokens} (mean {tokens / len(lengths):.1f}), torch threads {torch.get_num_threads()}"
    )
    print(
        f"mask fill per constrained row per step: median {statistics.median(fills) * 1e6:.1f} us, mean {statistics.mean(fills) * 1e6:.1f} us, p99 {sorted(fills)[int(0.99 * len(fills))] * 1e6:.1f} us ({len(fills)} steps)"
    )
    print(
        f"mask apply per row (batch of {args.requests}): {statistics.median(applies) / args.requests * 1e6:.1f} us"
    )
    print(f"with grammars: {tokens / with_grammar:.1f} out tok/s ({with_grammar:.2f} s)")
    print(f"without:       {tokens / without:.1f} out tok/s ({without:.2f} s)")
    print(f"ratio with / without: {without / with_grammar:.3f}")


if __name__ == "__main__":
    main()
