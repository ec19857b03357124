"""``deepinfer perplexity``: a text's perplexity, and KL divergence and top-1 agreement against
a saved base, by llama-perplexity's protocol (``quality/scoring.py``), with any engine
option."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.cli.engine_args import llm_kwargs


def perplexity(args: argparse.Namespace) -> int:
    """Score the file's text; print llama-perplexity's figures."""
    from deepinfer import LLM
    from deepinfer.quality import perplexity as score

    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"no text file {path}")
    llm = LLM(args.model, **llm_kwargs(args))
    report = score(
        llm,
        text=path.read_text(encoding="utf-8"),
        ctx=args.ctx,
        chunks=args.chunks,
        batch=args.batch,
        save_logits=args.save_logits,
        kl_base=args.kl_base,
        progress=True,
    )
    for line in report.lines():
        print(line)
    return 0


def add_perplexity_parser(sub: argparse._SubParsersAction, add_engine_arguments) -> None:
    ppl = sub.add_parser(
        "perplexity",
        help="perplexity of a text file, KL divergence and top-1 agreement against a saved base "
        "(llama-perplexity's protocol)",
    )
    ppl.add_argument("model")
    ppl.add_argument("file", help="a UTF-8 text file")
    ppl.add_argument(
        "--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored"
    )
    ppl.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    ppl.add_argument("--batch", type=int, default=4, help="chunks sent to the engine at a time")
    ppl.add_argument(
        "--save-logits", default=None, help="write this run's distributions as a base (safetensors)"
    )
    ppl.add_argument("--kl-base", default=None, help="a base written by --save-logits: report KL and top-1")
    add_engine_arguments(ppl, offline=True)
    ppl.set_defaults(func=perplexity)
