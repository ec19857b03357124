"""``deepinfer`` command line: ``make-tiny`` and ``generate`` (more subcommands land with
their issues: bench, serve, dump-graphs)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch


def _make_tiny(args: argparse.Namespace) -> int:
    from deepinfer.testing import make_tiny_checkpoint

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    quant = None if args.quant == "none" else args.quant
    path = make_tiny_checkpoint(
        args.path, arch=args.arch, seed=args.seed, dtype=dtype, quant=quant, shards=args.shards
    )
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"prompt: {out.prompt!r}")
        print(f"  tokens: {completion.token_ids}")
        print(f"  text:   {completion.text!r}  ({completion.finish_reason})")
    print(f"{generated} tokens in {elapsed:.3f}s: {generated / elapsed:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-class inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (no network needed)")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="deepseek_v4")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tiny.add_argument("--quant", choices=["none", "fp8"], default="none")
    tiny.add_argument("--shards", type=int, default=1)
    tiny.set_defaults(func=_make_tiny)

    gen = sub.add_parser("generate", help="offline generation from a checkpoint directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: say what is wrong, no traceback
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
