"""``deepinfer train-drafter``: train a DSpark head for a Llama-family target
(``deepinfer.drafter_training.recipe``) and print what it measured on held-out replies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_train_drafter_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train a DSpark draft head for a Llama-family model by self-distillation",
    )
    p.add_argument("model", help="checkpoint directory or a named model (smollm2-135m)")
    p.add_argument("--out", default=None, help="output directory (default: the cache, for a named model)")
    p.add_argument("--steps", type=int, default=4000, help="optimizer steps")
    p.add_argument("--prompts", type=int, default=1280, help="chat prompts the target replies to")
    p.add_argument("--max-tokens", type=int, default=192, help="longest reply")
    p.add_argument("--sampled-fraction", type=float, default=0.25, help="share of replies sampled (T=0.8)")
    p.add_argument(
        "--layers", default=None, help="comma-separated target layer ids (default: 4 spread evenly)"
    )
    p.add_argument("--num-layers", type=int, default=2, help="draft layers")
    p.add_argument("--block-size", type=int, default=5, help="draft tokens per proposal")
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft from this many of the replies' most frequent tokens (0: all; default 8192 for large vocabularies)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--soft-weight",
        type=float,
        default=1.0,
        help="weight of the cross entropy against the target's distribution (0: the paper's loss alone)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--confidence-label",
        choices=["greedy", "sampled"],
        default="greedy",
        help="what the confidence head predicts: greedy agreement, or 1 - TV (sampled decoding)",
    )
    p.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    p.set_defaults(func=train_drafter)


def train_drafter(args: argparse.Namespace) -> int:
    from deepinfer.drafter_training.recipe import train_drafter as run
    from deepinfer.drafter_training.train import TrainOptions
    from deepinfer.weights.catalog import NAMED_MODELS, draft_head_dir

    if args.out is None:
        if args.model not in NAMED_MODELS:
            raise ValueError(
                "--out is required for a checkpoint directory (the cache keeps named models' heads)"
            )
        out = draft_head_dir(args.model)
    else:
        out = Path(args.out)
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise ValueError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    for name in ("steps", "prompts", "max_tokens", "num_layers", "block_size", "markov_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.sampled_fraction <= 1.0:
        raise ValueError(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    options = TrainOptions(
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        warmup=min(100, max(1, args.steps // 10)),
        greedy_confidence=args.confidence_label == "greedy",
        soft_weight=args.soft_weight,
    )
    summary = run(
        args.model,
        out,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        sampled_fraction=args.sampled_fraction,
        layers=layers,
        options=options,
        head_shape={
            "num_layers": args.num_layers,
            "block_size": args.block_size,
            "markov_rank": args.markov_rank,
            **({} if args.draft_vocab is None else {"draft_vocab_size": args.draft_vocab}),
        },
        plot=Path(args.plot) if args.plot else None,
    )
    print(json.dumps({"out": str(out), **summary}, indent=2))
    return 0
