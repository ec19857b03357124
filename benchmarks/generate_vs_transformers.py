"""Eager decode throughput: deepinfer ``LLM.generate`` vs ``transformers.generate``, same
tiny DeepSeek-V4 checkpoint, same process, same prompts, greedy.

Run: ``python benchmarks/generate_vs_transformers.py [--new-tokens 64] [--batches 1 8]``.
Prints a markdown table for ``benchmarks/RESULTS.md``. The "limit" column is the machine's
ceiling for a memory-bound decoder: measured copy bandwidth / weight bytes read per decode
step (all attention + active experts); a tiny model sits far below it (overhead-bound).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench.workloads import decode_weight_bytes, measured_bandwidth_gbs
from deepinfer.tiny import make_tiny_checkpoint


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(path: Path, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, float]:
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    llm = LLM(path, max_num_seqs=batch)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, llm.vocab_size, (batch, prompt_len), generator=gen)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def ours() -> None:
        outs = llm.generate(prompts.tolist(), params)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    def theirs() -> None:
        with torch.no_grad():
            out = hf.generate(prompts, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        assert out.shape[1] == prompt_len + new_tokens

    t_ours, t_hf = _time(ours, repeats), _time(theirs, repeats)
    tokens = batch * new_tokens
    step_bytes = decode_weight_bytes(llm.model)
    limit = measured_bandwidth_gbs() * 1e9 / step_bytes * batch
    return {
        "batch": batch,
        "ours_tok_s": tokens / t_ours,
        "hf_tok_s": tokens / t_hf,
        "ratio": t_hf / t_ours,
        "limit_tok_s": limit,
        "ours_vs_limit": tokens / t_ours / limit,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: build a tiny V4 checkpoint")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_tiny_checkpoint(Path(tmp) / "tiny", arch="deepseek_v4", seed=0)
        print(
            f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}"
        )
        print(
            "| batch | deepinfer eager tok/s | transformers tok/s | ratio (ours/HF) | bandwidth limit tok/s | ours/limit |"
        )
        print("|---|---|---|---|---|---|")
        for batch in args.batches:
            r = run(path, batch, args.prompt_len, args.new_tokens, args.repeats)
            print(
                f"| {batch} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f}x "
                f"| {r['limit_tok_s']:.0f} | {r['ours_vs_limit']:.4f} |"
            )


if __name__ == "__main__":
    main()
