"""SmolLM2-135M's quality in each quantized mode, ours beside llama.cpp's at the same bits, in
one run on one text: perplexity by llama-perplexity's protocol, KL divergence and top-1
agreement against each side's full-precision run (``src/deepinfer/bench/quality.py``).

Run: ``python benchmarks/quality.py [--llama-cpp DIR] [--text FILE] [--ctx 512] [--chunks 32]``
where DIR is a llama.cpp checkout built with ``llama-perplexity`` and ``llama-quantize``
(``docs/benchmarks.md``, "Building the llama.cpp peer"). Without ``--text``, the text is
Python's own language reference as the interpreter ships it (``pydoc_data.topics``): English
prose any machine with Python has, identical for both sides.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.bench.quality import MODES, run_quality
from deepinfer.weights.catalog import resolve_model


def default_text() -> str:
    """Python's language reference topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp checkout")
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file (default: see above)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8") if args.text else default_text()
    run_quality(
        "smollm2-135m",
        resolve_model("smollm2-135m"),
        text,
        args.modes,
        ctx=args.ctx,
        chunks=args.chunks,
        llama_cpp=args.llama_cpp,
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
