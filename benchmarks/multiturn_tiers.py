"""Multi-turn conversations over a KV pool that holds only part of them, with and without the
prefix cache's host and disk tiers (SmolLM2-135M, CPU).

``--conversations`` sessions of ``--turns`` turns: each turn's prompt is the whole history
(a system prefix of ``--system`` tokens, every earlier user message and reply) plus a new user
message of ``--user`` tokens; the reply is ``--reply`` tokens (greedy, ``ignore_eos``). At most
``--concurrency`` requests run at once and sessions take turns round-robin, so a session comes
back after every other session has run a turn: by then the pool (``--pool-tokens``, a fraction
of what the conversations hold at the end) has evicted its history. The forms, in one process,
on the same requests:

- ``pool only``: the prefix cache in the pool, no tiers;
- ``host tier``: ``kv_offload_bytes`` large enough for every conversation;
- ``disk tier``: ``kv_cache_dir`` only (files on the local disk, no host tier);
- ``disk, new process``: the disk tier a ``disk tier`` run filled, read by a fresh engine
  (the restart case: only the prefix written by the earlier run is known).

Reported per form: mean and p90 time to first token, the time of the whole workload, output
tokens per second, and the prompt tokens served from each level (pool, host, disk) against
those computed. Every form computes the same replies (checked).

    python benchmarks/multiturn_tiers.py [--conversations 32] [--turns 8] [--pool-tokens 8192]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.weights.catalog import resolve_model

MODEL = "smollm2-135m"


def sessions(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(0)
    system = [rng.randrange(100, vocab) for _ in range(args.system)]
    return [
        [
            (system if t == 0 else []) + [rng.randrange(100, vocab) for _ in range(args.user)]
            for t in range(args.turns)
        ]
        for _ in range(args.conversations)
    ]


def run(llm: LLM, convs: list[list[list[int]]], args: argparse.Namespace) -> dict:
    """The whole workload through the engine: round-robin sessions, ``concurrency`` at once."""
    engine = llm.engine
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    history: list[list[int]] = [[] for _ in convs]
    queue = [(t, s) for t in range(args.turns) for s in range(len(convs))]  # round-robin
    ready_turn = [0] * len(convs)  # the next turn each session may send
    replies: dict[tuple[int, int], list[int]] = {}
    ttfts, prompt_tokens, cached, active = [], 0, 0, 0
    start = time.perf_counter()
    while queue or active:
        i = 0
        while active < args.concurrency and i < len(queue):
            t, s = queue[i]
            if ready_turn[s] != t:
                i += 1
                continue
            queue.pop(i)
            prompt = history[s] + convs[s][t]
            history[s] = prompt
            engine.add_request(f"{s}-{t}", prompt, params)
            prompt_tokens += len(prompt)
            active += 1
        for req in engine.step():
            if not req.finished:
                continue
            out = engine.make_output(req)
            engine.pop_finished(req.request_id)
            s, t = map(int, req.request_id.split("-"))
            reply = list(out.outputs[0].token_ids)
            replies[(t, s)] = reply
            history[s] = history[s] + reply
            ready_turn[s] = t + 1
            cached += out.num_cached_tokens
            ttfts.append(out.metrics.ttft)
            active -= 1
    wall = time.perf_counter() - start
    levels = {"pool": 0, "host": 0, "disk": 0}
    for m in llm.get_metrics():
        if m.name == "deepinfer:prefix_cache_hits":
            levels["pool"] = int(m.value)
        elif m.name == "deepinfer:kv_tier_hit_tokens":
            levels[m.labels["tier"]] = int(m.value)
    ttfts.sort()
    return {
        "replies": replies,
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall": wall,
        "tok_s": len(replies) * args.reply / wall,
        "prompt_tokens": prompt_tokens,
        "cached": cached,
        "levels": levels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=128)
    parser.add_argument("--user", type=int, default=48)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pool-tokens", type=int, default=8192)
    parser.add_argument("--host-gib", type=float, default=4.0)
    parser.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one)")
    args = parser.parse_args()

    path = resolve_model(MODEL)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="deepinfer-kv-"))
    shutil.rmtree(directory, ignore_errors=True)
    common = dict(block_size=16, num_cache_blocks=args.pool_tokens // 16, max_num_seqs=args.concurrency)
    forms = {
        "pool only": {},
        "host tier": {"kv_offload_bytes": int(args.host_gib * (1 << 30))},
        "disk tier": {"kv_cache_dir": str(directory)},
        "disk, new engine": {"kv_cache_dir": str(directory)},
    }
    probe = LLM(str(path), **common)
    convs = sessions(args, probe.vocab_size)
    final = sum(args.system + args.turns * (args.user + args.reply) for _ in convs)
    probe.close()
    print(
        f"{MODEL}: {args.conversations} conversations x {args.turns} turns, {final} tokens held at the end, "
        f"pool {args.pool_tokens} tokens ({args.pool_tokens / final:.0%} of them), concurrency {args.concurrency}"
    )
    results = {}
    for name, extra in forms.items():
        llm = LLM(str(path), **common, **extra)
        results[name] = run(llm, convs, args)
        llm.close()  # the disk tier's writes end before the next process reads them
        r = results[name]
        served = " ".join(f"{k} {v}" for k, v in r["levels"].items())
        print(
            f"{name:>18}: TTFT mean {r['ttft_mean'] * 1e3:7.1f} ms, p90 {r['ttft_p90'] * 1e3:7.1f} ms | "
            f"{r['wall']:6.1f} s, {r['tok_s']:6.1f} out tok/s | prompt {r['prompt_tokens']} tokens, "
            f"served {served}, computed {r['prompt_tokens'] - r['cached']}",
            flush=True,
        )
    base = results["pool only"]
    for name, r in results.items():
        assert r["replies"] == base["replies"], f"{name}: replies differ from the pool-only run"
        print(
            f"{name:>18}: TTFT {base['ttft_mean'] / r['ttft_mean']:.2f}x lower, "
            f"throughput {r['tok_s'] / base['tok_s']:.2f}x of pool only"
        )
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
