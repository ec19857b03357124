"""Each feature on the CPU's fastest path against the same feature eager and against the base
model without it, SmolLM2-135M, in one run.

The CPU's fastest decode path is the one-call decode stack (the whole layer stack in one C++
call); "eager" is the same engine with the stack switched off, so every step runs the model's
layer loop. Features: LoRA (a batch mixing eight rank-16 adapters on every linear), the KV
cache's host tier (a pool too small for the prompts' prefixes, so turns come back from the
tier; its base is the same pool without a tier), n-gram speculative decoding, and an engine over a trainer's module (``LLM.from_model``,
which checks the parameters' version counters every step). Routed-expert return needs a MoE
model: it has no row here.

Every form computes the same tokens: each request has the same prompt length and generates
``--tokens`` tokens (``ignore_eos``). Throughput is generated tokens per second, the best of
``--repeats`` rounds that run every form in turn after a warm-up round.

    python benchmarks/feature_modes.py [--requests 16] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from lora_throughput import ADAPTERS, TARGETS, alternated, make_adapters

from deepinfer import LLM, LoRARequest, SamplingParams, load_model
from deepinfer.engine import setup as engine_setup
from deepinfer.weights.catalog import resolve_model

MODEL = "smollm2-135m"


def build(path: Path, eager: bool, from_model: bool = False, **options) -> LLM:
    """An engine on the fastest path, or with the one-call stack off (``eager``); over a
    trainer's module (``LLM.from_model``) when ``from_model``."""

    def make() -> LLM:
        if from_model:
            return LLM.from_model(load_model(path, requires_grad=True), **options)
        return LLM(path, **options)

    if not eager:
        return make()
    with mock.patch.object(engine_setup, "one_call_decode", lambda model: None):
        return make()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = resolve_model(MODEL)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(1000, 40000, (args.prompt_len - 16,), generator=gen).tolist()
    prompts = [
        shared + torch.randint(1000, 40000, (16,), generator=gen).tolist() for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    common = dict(max_num_seqs=args.requests, compile=False)
    with tempfile.TemporaryDirectory() as tmp:
        _, dirs = make_adapters(path, Path(tmp), 16, TARGETS["all"])
        spread = [
            LoRARequest(f"a{i % ADAPTERS}", i % ADAPTERS + 1, str(dirs[i % ADAPTERS]))
            for i in range(args.requests)
        ]
        # a pool that holds about two requests' prompts: the shared prefix is evicted and comes
        # back from the host tier
        blocks = 2 * (args.prompt_len + args.tokens) // 16 + 4
        small_pool = dict(num_cache_blocks=blocks, block_size=16)
        features: dict[str, tuple[dict, dict]] = {
            "none (the base model)": ({}, {}),
            "LoRA, 8 adapters": (
                dict(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=16),
                {"lora_request": spread},
            ),
            "KV host tier": (dict(kv_offload_bytes=1 << 30, **small_pool), {}),
            "n-gram speculation": (
                dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                {},
            ),
            "engine over a trainer's module": (dict(from_model=True), {}),
        }
        bases = {False: build(path, False, **common), True: build(path, False, **common, **small_pool)}

        def run(llm: LLM, extra: dict) -> Callable[[], int]:
            return lambda: len(llm.generate(prompts, params, use_tqdm=False, **extra)) * args.tokens

        rows = []
        for name, (options, extra) in features.items():  # one group per feature, the base in each
            fast, slow = build(path, False, **common, **options), build(path, True, **common, **options)
            base = bases["kv_offload_bytes" in options]  # the tier's base: the same small pool
            rates = alternated(
                {"base": run(base, {}), "fast": run(fast, extra), "slow": run(slow, extra)}, args.repeats
            )
            rows.append((name, rates))
            for llm in (fast, slow):
                llm.close()
            del fast, slow
            gc.collect()
    print(
        f"SmolLM2-135M, {args.requests} requests x {args.prompt_len} prompt + {args.tokens} generated tokens, "
        f"torch threads {torch.get_num_threads()}; fastest: the one-call decode stack, eager: the layer loop"
    )
    print("  base: the fastest engine without the feature (for the tier: the same small pool, no tier)")
    print(f"  {'feature':32s} {'fastest':>9s} {'eager':>9s} {'base':>9s}  fastest/eager  fastest/base")
    for name, r in rows:
        print(
            f"  {name:32s} {r['fast']:9.1f} {r['slow']:9.1f} {r['base']:9.1f}  "
            f"{r['fast'] / r['slow']:13.3f}  {r['fast'] / r['base']:12.3f}"
        )


if __name__ == "__main__":
    main()
