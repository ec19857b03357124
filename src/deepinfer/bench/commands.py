"""What each ``deepinfer bench`` subcommand runs, given its parsed flags (``cli/bench.py``).
The engine and the peers are imported inside each command, so the parser builds without
them."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# run as a script file, so the clock starts before anything of deepinfer or torch is imported
_STARTUP_WORKER = Path(__file__).with_name("startup_worker.py")


def round_workload(args: argparse.Namespace, vocab_size: int, round_: int):
    """Round ``round_``'s requests for ``bench throughput``: the same for both sides, new prompts
    each round (a rerun of the same prompts would hit our prefix cache, which the peer lacks).
    Round 0 is ``--seed``'s workload; the warm-up uses ``--seed + 1``."""
    from deepinfer.bench.workloads import random_workload

    seed = args.seed + 1000 * round_
    return random_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, seed=seed
    )


def throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Offline throughput against ``transformers.generate`` on the same requests;
    ``engine_kwargs``: ``LLM``'s options from the command's engine flags."""
    from deepinfer import LLM
    from deepinfer.bench.workloads import (
        PeerProcesses,
        decode_bs1,
        deepinfer_throughput,
        load_transformers_peer,
        random_workload,
        transformers_throughput_runs,
    )
    from deepinfer.tiny import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            Path(args.model) if args.model else make_tiny_checkpoint(Path(tmp) / "tiny", arch="deepseek_v4")
        )
        batching = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
        llm = LLM(path, **(engine_kwargs | batching))
        if llm.engine.runner.padding is not None:  # compiled: graphs built before the clock starts
            warm = random_workload(
                16, tuple(args.prompt_len), tuple(args.output_len), llm.vocab_size, seed=args.seed + 1
            )
            deepinfer_throughput(llm, warm)
        peer = load_transformers_peer(llm.path) if args.peer_batch_sizes else None
        # replicas on our side: the peer also runs as that many processes (the fair split)
        replicas = args.data_parallel_replicas
        peer_threads = max(1, args.threads // replicas)
        peer_processes = (
            PeerProcesses(llm.path, replicas, peer_threads)
            if args.peer_batch_sizes and replicas > 1
            else None
        )
        ratios = []
        for round_ in range(args.rounds):  # rounds alternate the two sides on a noisy machine
            if args.rounds > 1:
                print(f"round {round_ + 1} of {args.rounds}")
            work = round_workload(args, llm.vocab_size, round_)  # no prefix-cache hits on a rerun
            ours = deepinfer_throughput(llm, work)
            print(
                f"deepinfer: {ours:.1f} output tok/s ({args.num_requests} requests, {work.output_tokens} tokens)"
            )
            if peer is None:
                continue
            runs = transformers_throughput_runs(peer, work, args.peer_batch_sizes)
            for run in runs:
                order = "length-sorted" if run.sort else "arrival order"
                print(
                    f"transformers.generate batch {run.batch_size}, {order}: "
                    f"{run.tok_s:.1f} output tok/s ({run.computed_tokens} tokens computed for "
                    f"{run.credited_tokens} requested)"
                )
            if peer_processes is not None:
                for bs in args.peer_batch_sizes:
                    run = peer_processes.run(work, bs)
                    runs.append(run)
                    print(
                        f"transformers.generate batch {bs}, length-sorted, {replicas} processes x "
                        f"{peer_threads} thread(s): {run.tok_s:.1f} output tok/s "
                        f"({run.computed_tokens} tokens computed for {run.credited_tokens} requested)"
                    )
            best = max(runs, key=lambda r: r.tok_s)
            ratios.append(ours / best.tok_s)
            print(f"ratio deepinfer / best transformers: {ratios[-1]:.2f}x")
        if len(ratios) > 1:
            listed = ", ".join(f"{r:.2f}x" for r in ratios)
            print(
                f"ratio over {len(ratios)} alternated rounds: median {statistics.median(ratios):.2f}x ({listed})"
            )
        bs1 = decode_bs1(llm)
        print(
            f"bs=1 decode: {bs1['decode_tok_s']:.1f} tok/s; bandwidth bound {bs1['bound_tok_s']:.0f} tok/s "
            f"({100 * bs1['fraction_of_bound']:.2f}% of it)"
        )
        if llm.engine.spec is not None:
            for line in llm.engine.spec.stats.report(llm.engine.spec.config.method):
                print(line)
        llm.close()
        if peer_processes is not None:
            peer_processes.close()
    return 0


def startup(args: argparse.Namespace) -> int:
    """Time from process start to the first token, cold (fresh process, twice) per engine. With
    ``--compile on`` deepinfer's first process compiles and saves its step, the second loads it."""
    for kind in ("deepinfer", "transformers"):
        for attempt in ("first", "second"):
            out = subprocess.run(
                # -P: the worker's folder stays off sys.path (its modules are not top-level ones)
                [sys.executable, "-P", str(_STARTUP_WORKER), kind, args.model, args.compile],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            print(
                f"{kind:12s} {attempt} process: {float(out[0]):.2f}s to first token, peak RSS {float(out[1]):.0f} MiB"
            )
    return 0


def batched(args: argparse.Namespace) -> int:
    """llama-batched-bench's table on our engine, and llama.cpp's beside it when there is one."""
    from deepinfer.bench.llama_cpp import default_llama_cpp, run_table

    llama_cpp = Path(args.llama_cpp) if args.llama_cpp else default_llama_cpp()
    run_table(
        args.model,
        args.variants,
        args.batches,
        llama_cpp=llama_cpp,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        threads=args.threads,
        print_fn=lambda line: print(line, flush=True),
    )
    return 0


def latency(args: argparse.Namespace) -> int:
    """TTFT, TPOT and output tok/s per concurrency, ours then the ``transformers`` peer's."""
    from deepinfer import LLM
    from deepinfer.bench.workloads import (
        deepinfer_latency,
        load_transformers_peer,
        peak_rss_mib,
        transformers_latency,
    )

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=max(args.concurrency))
    rows = []
    for c in args.concurrency:
        rows.append(("deepinfer", c, deepinfer_latency(llm, c, args.prompt_len, args.output_len)))
    ours_peak = peak_rss_mib()
    peer = load_transformers_peer(llm.path)
    for c in args.concurrency:
        rows.append(
            (
                "transformers",
                c,
                transformers_latency(peer, c, args.prompt_len, args.output_len, llm.vocab_size),
            )
        )
    print("| engine | concurrency | TTFT s | TPOT ms | output tok/s |")
    print("|---|---|---|---|---|")
    for name, c, r in rows:
        print(f"| {name} | {c} | {r['ttft_s']:.3f} | {1000 * r['tpot_s']:.1f} | {r['tok_s']:.1f} |")
    print(f"peak RSS: deepinfer alone {ours_peak:.0f} MiB, with the peer loaded {peak_rss_mib():.0f} MiB")
    if args.plot:
        from deepinfer.bench.plot import plot_latency  # matplotlib only when a plot is asked for

        plot_latency(rows, Path(str(args.model)).name, args.plot)
        print(f"wrote {args.plot}")
    return 0


def serve(args: argparse.Namespace) -> int:
    """``bench serve``'s flags checked, then the load generator (``bench/serve.py``)."""
    from deepinfer.bench.serve import main as bench_serve

    if (
        args.num_prompts < 1
        or args.output_len < 1
        or (args.max_concurrency is not None and args.max_concurrency < 1)
    ):
        raise ValueError("--num-prompts, --output-len and --max-concurrency must be >= 1")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    return bench_serve(args)
