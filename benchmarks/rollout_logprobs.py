"""How far a rollout's logprobs are from the trainer's: for each model, an engine over the module
being trained (``LLM.from_model``) samples completions, and the training forward (gradients
on) recomputes the sampled tokens' ``log_softmax``; printed: the largest absolute gap and the
share of tokens equal bit for bit, with and without ``batch_invariant``.

Models: SmolLM2-135M and tiny random V4 and V4.1 checkpoints (``deepinfer.tiny``).

    python benchmarks/rollout_logprobs.py [--prompts 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint


def gaps(model: torch.nn.Module, invariant: bool, prompts: list[list[int]], max_tokens: int) -> list[float]:
    llm = LLM.from_model(model, batch_invariant=invariant)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, logprobs=0, ignore_eos=True)
    found = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        ids = torch.tensor([prompt + c.token_ids])
        logp = model(ids, batch_invariant=invariant).logits.log_softmax(-1)[0]
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            found.append(abs(entry[token].logprob - logp[len(prompt) - 1 + i, token].item()))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {
            "SmolLM2-135M": "smollm2-135m",
            "tiny V4": make_tiny_checkpoint(Path(tmp) / "v4", arch="deepseek_v4", seed=1),
            "tiny V4.1": make_tiny_checkpoint(Path(tmp) / "v41", arch="deepseek_v41", seed=1),
        }
        print(f"{'model':<14} {'mode':<17} {'tokens':>6} {'max |gap|':>10} {'bitwise':>8}")
        for name, source in sources.items():
            model = load_model(source, requires_grad=True)
            vocab = min(model.config.vocab_size, 30000)
            prompts = [
                [rng.randrange(2, vocab) for _ in range(rng.randrange(8, 80))] for _ in range(args.prompts)
            ]
            for invariant in (True, False):
                found = gaps(model, invariant, prompts, args.max_tokens)
                mode = "batch_invariant" if invariant else "default"
                exact = sum(g == 0.0 for g in found) / len(found)
                print(f"{name:<14} {mode:<17} {len(found):>6} {max(found):>10.2e} {exact:>8.1%}")


if __name__ == "__main__":
    main()
