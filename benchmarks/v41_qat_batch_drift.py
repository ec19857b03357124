"""How far V4.1's QAT rounding moves a request's chosen-token logprobs between running it
alone and in a batch (tiny random V4.1 checkpoint, greedy). With ``fake_quant`` off the two
agree to float rounding; with it on, last-bit differences between batch shapes land values
on other grid points and the drift compounds over the generation. Prints one markdown row
per setting for ``benchmarks/RESULTS.md``.

    python benchmarks/v41_qat_batch_drift.py
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint


def drift(path: Path, fake_quant: bool, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(largest chosen-token logprob difference over the steps where alone and batched still
    agree, requests whose greedy tokens differ)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    alone_llm = LLM(path, fake_quant=fake_quant, enable_prefix_caching=False)
    alone = [alone_llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    batched = [
        o.outputs[0] for o in LLM(path, fake_quant=fake_quant).generate(prompts, params, use_tqdm=False)
    ]
    worst, differing = 0.0, 0
    for a, b in zip(alone, batched, strict=True):
        differing += a.token_ids != b.token_ids
        for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                break
            worst = max(worst, abs(a.logprobs[k][x].logprob - b.logprobs[k][x].logprob))
    return worst, differing


def main() -> None:
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "v41", arch="deepseek_v41", seed=0)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    print(
        "| fake_quant | requests | tokens each | max logprob drift, alone vs batched | requests whose tokens differ |"
    )
    print("|---|---:|---:|---:|---:|")
    for fake_quant in (False, True):
        worst, differing = drift(path, fake_quant, prompts, 40)
        print(f"| {fake_quant} | {len(prompts)} | 40 | {worst:.2e} | {differing} |", flush=True)


if __name__ == "__main__":
    main()
