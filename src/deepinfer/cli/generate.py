"""``deepinfer generate``: offline generation, the answers on stdout and the figures about the
run on stderr."""

from __future__ import annotations

import argparse
import sys
import time

from deepinfer.cli.engine_args import llm_kwargs


def generate(args: argparse.Namespace) -> int:
    """Generate for each ``--prompt``, through the chat template when the checkpoint has one
    (as llama.cpp's CLI does) unless ``--raw``."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, **llm_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.chat and args.raw:
        raise ValueError("give --chat or --raw, not both")
    # as llama.cpp's CLI does: an instruct model's prompt goes through its chat template
    chat = args.chat or (not args.raw and getattr(llm.tokenizer, "chat_template", None) is not None)
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        for out, p in zip(outputs, args.prompt, strict=True):
            out.prompt = p
    else:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"prompt: {out.prompt!r}" + ("  (chat template)" if chat else ""))
        print(f"  tokens: {completion.token_ids}")
        print(f"  text:   {completion.text!r}  ({completion.finish_reason})")
    # figures about the run, not its answers: on stderr, so stdout is the answers alone
    print(f"{generated} tokens in {elapsed:.3f}s: {generated / elapsed:.1f} tokens/s", file=sys.stderr)
    spec = llm.engine.spec
    if spec is not None:
        for line in spec.stats.report(spec.config.method):
            print(line, file=sys.stderr)
    return 0
