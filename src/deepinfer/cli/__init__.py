"""``deepinfer`` command line: ``make-tiny``, ``plan``, ``generate``, ``serve``, ``chat``,
``bench throughput|latency|batched|serve|startup``, ``perplexity``, ``dump-graphs`` and
``train-drafter``. The argparse tree is
in ``parser`` (shared flag groups in ``arguments``), flags become engine options in
``engine_args``, each command's handler has its own module (the benchmarks' in
``deepinfer.bench``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from deepinfer.cli.parser import build_parser
from deepinfer.cli.torchrun import follow, ranks_from_torchrun

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run its command; bad input is an exit status of 2 and one line on
    stderr, not a traceback. Under torchrun, ranks other than 0 follow rank 0."""
    args = build_parser().parse_args(argv)
    try:
        ranks = ranks_from_torchrun(args)
        if ranks is not None and ranks[0] != 0:
            return follow(args, *ranks)
        return args.func(args)
    except ValueError as exc:  # bad input: say what is wrong, no traceback
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
