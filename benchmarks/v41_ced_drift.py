"""How far V4.1's causal encoder/decoder (CED) prefill moves the logits from the exact
forward, and what it saves, on a tiny V4.1 checkpoint (the engine option ``ced_prefill``).

Run: ``python benchmarks/v41_ced_drift.py [--lengths 16 64 256 1024] [--steps 8] [--model DIR]``.
For each prompt length: the largest |log-prob difference| over the vocabulary at the last
prompt token and over ``steps`` greedy decode steps (the exact run's tokens are fed to both,
so the two runs stay aligned), whether the greedy choice agrees at every step, the share of
prompt rows the decoder layers ran, and the prefill wall time of both. With random tiny
weights the drift only shows the mechanism's size, not the trained model's quality.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.cache.session import Session
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint


def measure(model, prompt: torch.Tensor, steps: int) -> dict[str, float]:
    window, length = model.config.sliding_window, prompt.shape[1]
    runs = {}
    for name, replay_from in (("exact", 0), ("ced", max(0, length - window))):
        session = Session(model, prompt.shape[0], length + steps)
        start = time.perf_counter()
        logits = [session.feed(prompt, replay_from=replay_from, last_logits_only=True)]
        prefill_s = time.perf_counter() - start
        runs[name] = (logits, prefill_s, session, replay_from)
    # decode both on the exact run's greedy tokens
    for _ in range(steps):
        token = runs["exact"][0][-1].argmax(-1)
        for _name, (logits, _, session, replay_from) in runs.items():
            logits.append(session.feed(token, replay_from=replay_from))
    exact = torch.cat(runs["exact"][0], 1).log_softmax(-1)
    ced = torch.cat(runs["ced"][0], 1).log_softmax(-1)
    drift = (exact - ced).abs().amax(dim=(0, 2))
    return {
        "prefill_drift": float(drift[0]),
        "decode_drift": float(drift[1:].max()) if steps else 0.0,
        "greedy_agree": float((exact.argmax(-1) == ced.argmax(-1)).float().mean()),
        "decoder_rows": min(length, window) / length,
        "exact_s": runs["exact"][1],
        "ced_s": runs["ced"][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--model", type=Path, default=None, help="a V4.1 checkpoint (default: tiny)")
    args = parser.parse_args()
    path = args.model or make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "v41", arch="deepseek_v41")
    model = load_model(path)
    vocab = model.config.vocab_size
    print(f"model: {path}, window {model.config.sliding_window}, CED split at layer {model.ced_split}")
    print(
        "| prompt | max abs d-logprob, last prompt token | max over decode steps | greedy agrees "
        "| decoder rows | prefill exact (s) | prefill CED (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for length in args.lengths:
            prompt = torch.randint(2, vocab, (args.batch, length), generator=gen)
            r = measure(model, prompt, args.steps)
            print(
                f"| {length} | {r['prefill_drift']:.3g} | {r['decode_drift']:.3g} | {r['greedy_agree']:.0%} "
                f"| {r['decoder_rows']:.1%} | {r['exact_s']:.3f} | {r['ced_s']:.3f} |"
            )


if __name__ == "__main__":
    main()
