"""``deepinfer serve`` against ``transformers serve --continuous-batching`` on the same SmolLM2
weights, with ``deepinfer bench serve``'s load generator at several concurrencies.

Each server runs in its own process on this machine (never at the same time), gets one
warm-up request, then for each concurrency C: 2C (at least 8) requests of ``--input-len``
random words, ``--output-len`` greedy tokens at most, C at a time. Both stream; tokens are
counted from each server's usage chunk.

Run: ``python benchmarks/serve_vs_transformers.py [--concurrency 1 8 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from deepinfer.bench.serve import make_requests, run, summarize
from deepinfer.weights.catalog import resolve_model


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up")


def bench(url: str, model: str, concurrencies: list[int], input_len: int, output_len: int) -> dict[int, dict]:
    warm = make_requests("random", 1, input_len, seed=99)
    asyncio.run(run(url, model, warm, 4, 1, float("inf")))
    rows = {}
    for c in concurrencies:
        requests = make_requests("random", max(16, 4 * c), input_len, seed=c)  # tails aside
        results, duration = asyncio.run(run(url, model, requests, output_len, c, float("inf")))
        rows[c] = summarize(results, duration)
        print(f"  {url} c={c}: {rows[c]['output_token_throughput']:.1f} out tok/s", flush=True)
    return rows


def serve(cmd: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_ready(url)
    return proc


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def bench_ours(concurrency: list[int], input_len: int, output_len: int) -> dict[int, dict]:
    """``deepinfer serve smollm2-135m`` on port 8100 under the same load."""
    url = "http://127.0.0.1:8100"
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "serve",
        "smollm2-135m",
        "--port",
        "8100",
        "--max-num-seqs",
        "64",
    ]
    proc = serve(cmd, url)
    try:
        return bench(url, "smollm2-135m", concurrency, input_len, output_len)
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    path = str(resolve_model("smollm2-135m"))
    theirs_url = "http://localhost:8101"
    results = {}
    results["deepinfer"] = bench_ours(args.concurrency, args.input_len, args.output_len)
    proc = serve(["transformers", "serve", path, "--continuous-batching", "--port", "8101"], theirs_url)
    try:
        results["transformers"] = bench(theirs_url, path, args.concurrency, args.input_len, args.output_len)
    finally:
        stop(proc)
    print_table(results, args.concurrency)


def print_table(results: dict[str, dict[int, dict]], concurrency: list[int]) -> None:
    """The markdown table of RESULTS.md: ours (first key) against the peer (second key)."""
    ours, peer = list(results)
    print(
        f"| concurrency | requests | {ours} out tok/s | {peer} out tok/s | ratio | "
        f"{ours} TTFT / TPOT median (ms) | {peer} TTFT / TPOT median (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in concurrency:
        a, b = results[ours][c], results[peer][c]
        peer_tps = b["output_token_throughput"]
        ratio = a["output_token_throughput"] / peer_tps if peer_tps else float("inf")
        print(
            f"| {c} | {a['successful_requests']}/{b['successful_requests']} | {a['output_token_throughput']:.1f} | "
            f"{peer_tps:.1f} | {ratio:.2f}x | {a['ttft_ms']['median']:.0f} / {a['tpot_ms']['median']:.1f} | "
            f"{b['ttft_ms']['median']:.0f} / {b['tpot_ms']['median']:.1f} |"
        )
        for name, r in ((ours, a), (peer, b)):
            if r["errors"]:
                print(f"  {name} errors at c={c}: {r['errors']}")


if __name__ == "__main__":
    main()
