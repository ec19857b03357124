"""Offline generation on the embedded default model.

Until a real small model ships in a wheel, the default is a tiny random DeepSeek-V4-Flash
checkpoint built on the fly (random weights: the tokens are meaningless, the machinery is
real). Pass a checkpoint directory as the first argument to use your own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.testing import make_tiny_checkpoint

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-deepseek-v4"


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    if not (path / "config.json").is_file():
        print(f"building a tiny DeepSeek-V4 checkpoint in {path}")
        make_tiny_checkpoint(path, arch="deepseek_v4", seed=0)
    llm = LLM(path)
    prompts = ["The capital of France is", "def fibonacci(n):", "Mixture of experts"]
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = 0
    for out in outputs:
        completion = out.outputs[0]
        total += len(completion.token_ids)
        print(f"\nprompt: {out.prompt!r}\n  token ids: {completion.token_ids}\n  text: {completion.text!r}")
    print(f"\n{total} tokens in {elapsed:.2f}s = {total / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
