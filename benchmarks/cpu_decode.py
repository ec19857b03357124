"""SmolLM2-135M on the CPU in llama.cpp's ``llama-batched-bench`` shape, against llama.cpp in
the same run when its checkout is given: the script behind RESULTS.md's tables,
now ``deepinfer bench batched`` (``src/deepinfer/bench/llama_cpp.py``), kept under its old name
so the recorded commands still run.

B sequences of 144-token prompts, 64 output tokens each; per B: prefill tok/s (``S_PP``),
decode tok/s (``S_TG``) and the whole shape's output tok/s (B x 64 / wall), for our fp32, fp32
with an fp16 KV cache, bf16, int8 and int4 against llama.cpp F32, Q8_0 and Q4_0 converted from
the same checkpoint.

Run: ``python benchmarks/cpu_decode.py [--llama-cpp DIR] [--batches 1 8 16 32] [--variants ...]``
where DIR is a llama.cpp checkout built with ``llama-batched-bench`` and ``llama-quantize``
(``docs/benchmarks.md``, "Building the llama.cpp peer").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.bench.llama_cpp import VARIANTS, run_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp checkout")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    run_table("smollm2-135m", args.variants, args.batches, llama_cpp=args.llama_cpp, threads=2)


if __name__ == "__main__":
    main()
