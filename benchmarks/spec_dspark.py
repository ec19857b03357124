"""DSpark on SmolLM2-135M-Instruct with the head ``deepinfer train-drafter smollm2-135m``
trained, against no speculation, n-gram drafts and llama.cpp F32 on the same chat prompts.

The prompts are the recipe's held-out set (``drafter_training.prompts``: templates and topics
the head never saw in training, free-form replies, no copying). Every engine decodes greedily
with the reply's own end (no ``ignore_eos``), so each side computes the tokens its model
chooses; our modes' outputs are checked equal to the plain run's. Batch 1 sends the prompts one
at a time; batch 8 eight at a time. Each of our modes runs ``--rounds`` times, alternating,
and its best round is reported (the machine drifts between runs). llama.cpp is
``llama-server`` (``--llama-server BIN --gguf FILE``) with 8 slots and 2 threads, sent the same
conversations through its chat endpoint one at a time and eight at a time.

Reports output tok/s, the ratio to no speculation, DSpark's mean acceptance length, its
acceptance by draft position and the confidence head's predicted against observed survival.
Run: ``python benchmarks/spec_dspark.py [--head smollm2-135m-dspark] [--prompts 16]
[--llama-server BIN --gguf FILE]``; prints a markdown table for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.drafter_training.dataset import reply
from deepinfer.drafter_training.prompts import chat_prompts

MODES = {
    "plain": None,
    "n-gram k=5": {"method": "ngram", "num_speculative_tokens": 5},
    "DSpark static": {"method": "dspark", "schedule": "static"},
    "DSpark hardware": {"method": "dspark", "schedule": "hardware"},
}


def run_mode(
    model: str, spec: dict | None, convs: list, batch: int, max_tokens: int
) -> tuple[float, list, dict | None]:
    """Output tok/s, the outputs, and the speculative figures of one mode at one batch size."""
    llm = LLM(model, max_num_seqs=max(batch, 1), speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reply(llm, convs[:batch], params)  # warm-up (its figures are dropped below)
    if llm.engine.spec is not None:
        llm.engine.spec.stats = type(llm.engine.spec.stats)()
    outs, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(convs), batch):
        got = reply(llm, convs[i : i + batch], params)
        outs += [o.outputs[0].token_ids for o in got]
        tokens += sum(len(o.outputs[0].token_ids) for o in got)
    seconds = time.perf_counter() - start
    stats = llm.engine.spec.stats.summary() if llm.engine.spec is not None else None
    llm.close()
    del llm
    gc.collect()
    return tokens / seconds, outs, stats


def llama_server_rows(
    binary: str, gguf: str, convs: list, batches: list[int], max_tokens: int
) -> dict[int, float]:
    """llama-server's output tok/s on the same conversations at each batch size."""
    import subprocess

    from serve_vs_transformers import serve, stop

    url = "http://127.0.0.1:8103"
    cmd = [binary, "-m", gguf, "--port", "8103", "-t", "2", "-tb", "2", "--parallel", "8", "-c", "8192"]
    proc: subprocess.Popen = serve(cmd, url)

    def ask(conv) -> int:
        body = {"messages": conv, "max_tokens": max_tokens, "temperature": 0.0}
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            return int(json.loads(resp.read())["usage"]["completion_tokens"])

    rows = {}
    try:
        ask(convs[0])  # warm-up
        for batch in batches:
            start, tokens = time.perf_counter(), 0
            with ThreadPoolExecutor(batch) as pool:
                for i in range(0, len(convs), batch):
                    tokens += sum(pool.map(ask, convs[i : i + batch]))
            rows[batch] = tokens / (time.perf_counter() - start)
    finally:
        stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--head", default="smollm2-135m-dspark", help="DSpark head: directory or cached name")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    convs = chat_prompts(args.prompts, seed=1, held_out=True)
    modes = {
        name: (dict(spec, model=args.head) if spec and spec["method"] == "dspark" else spec)
        for name, spec in MODES.items()
    }
    best: dict[tuple[str, int], float] = {}
    figures: dict[tuple[str, int], dict | None] = {}
    for batch in args.batch:
        plain_out = None
        for _ in range(args.rounds):
            for name, spec in modes.items():
                tok_s, outs, stats = run_mode(args.model, spec, convs, batch, args.max_tokens)
                if plain_out is None:
                    plain_out = outs
                elif outs != plain_out:
                    raise SystemExit(f"{name} at batch {batch}: outputs differ from the plain run's")
                print(f"batch {batch} {name}: {tok_s:.1f} tok/s {stats or ''}", flush=True)
                if tok_s > best.get((name, batch), 0.0):
                    best[(name, batch)], figures[(name, batch)] = tok_s, stats
    peer = {}
    if args.llama_server and args.gguf:
        peer = llama_server_rows(args.llama_server, args.gguf, convs, args.batch, args.max_tokens)
    print(
        "\n| batch | engine | output tok/s | vs plain | vs llama.cpp F32 | acceptance length | acceptance by position | predicted/observed survival |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---|")
    for batch in args.batch:
        plain = best[("plain", batch)]
        for name in modes:
            tok_s, stats = best[(name, batch)], figures[(name, batch)]
            vs_peer = f"{tok_s / peer[batch]:.2f}x" if batch in peer else "-"
            accept = f"{stats['mean_acceptance_length']:.2f}" if stats else "-"
            by_pos = " ".join(f"{a:.2f}" for a in stats["acceptance_by_position"]) if stats else "-"
            calib = (
                " ".join(f"{p:.2f}/{o:.2f}" for p, o in stats["calibration"])
                if stats and stats["calibration"]
                else "-"
            )
            print(
                f"| {batch} | deepinfer {name} | {tok_s:.1f} | {tok_s / plain:.2f}x | {vs_peer} | {accept} | {by_pos} | {calib} |"
            )
        if batch in peer:
            print(
                f"| {batch} | llama.cpp F32 (llama-server) | {peer[batch]:.1f} | {peer[batch] / plain:.2f}x | 1.00x | - | - | - |"
            )


if __name__ == "__main__":
    main()
