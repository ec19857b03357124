"""Prefill/decode disaggregation against one colocated server, on loopback, SmolLM2-135M.

Disaggregated: a prefill server pinned to core 0 and a decode server (``--kv-peer``) pinned to
core 1, one thread each. Colocated: one server on both cores, two threads, with its default
step budget (1,024 tokens) and with prefill chunks of 128 (shorter stalls for the streams);
the pair also with ``--kv-remote-min-tokens 128`` (the streams' short prompts prefilled by the
decode server itself, sparing their round trip). Each form serves
the same workload in turn (never both at once): ``--streams`` short prompts stream
``--stream-tokens`` tokens each from the start, while ``--long`` long prompts (distinct, no
prefix shared with anything, so no cache helps either side) arrive one every ``--gap``
seconds. Each form serves a warm-up workload, then ``--rounds`` workloads with their own
prompts, pooled. Reported per form: the decoding streams' inter-token latency p50/p99/max
(the time between streamed chunks after the first, one token per chunk), the time to first
token of the streams and of the long prompts, and a workload's mean wall time.

Run: ``python benchmarks/pd_disagg.py [--model smollm2-135m]``; prints a markdown table for
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

WORDS = (
    "river stone cloud garden lamp orbit violin market winter copper forest signal harbor "
    "meadow engine lantern thunder crystal pepper canyon silver ribbon falcon marble"
).split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``deepinfer serve`` pinned to ``cores`` with as many threads."""

    def __init__(self, model: str, cores: str, *args: str) -> None:
        self.port = _free_port()
        threads = str(len(cores.split(",")))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        command = ["taskset", "-c", cores, sys.executable, "-m", "deepinfer.cli", "serve", model]
        command += ["--port", str(self.port), "--max-model-len", "1024", "--no-ui", *args]
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, start: float) -> dict:
    """One streamed completion: its first-token time and its chunks' arrival times."""
    await asyncio.sleep(start)
    sent = time.perf_counter()
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return {"ttft": times[0] - sent, "gaps": [b - a for a, b in zip(times, times[1:], strict=False)]}


async def _workload(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    streams = [_text(rng, 30) for _ in range(args.streams)]
    longs = [_text(rng, args.long_words) for _ in range(args.long)]
    async with httpx.AsyncClient(timeout=600) as client:
        began = time.perf_counter()
        jobs = [_stream(client, url, p, args.stream_tokens, 0.0) for p in streams]
        jobs += [_stream(client, url, p, 8, args.gap * (i + 1)) for i, p in enumerate(longs)]
        results = await asyncio.gather(*jobs)
        wall = time.perf_counter() - began
    gaps = [g for r in results[: args.streams] for g in r["gaps"]]
    return {
        "itl": gaps,
        "ttft_streams": [r["ttft"] for r in results[: args.streams]],
        "ttft_long": [r["ttft"] for r in results[args.streams :]],
        "wall": wall,
    }


def _rounds(url: str, args: argparse.Namespace) -> dict:
    """A warm-up workload, then ``--rounds`` workloads (each its own prompts), figures pooled."""
    asyncio.run(_workload(url, argparse.Namespace(**{**vars(args), "seed": 10_000})))
    pooled: dict = {"itl": [], "ttft_streams": [], "ttft_long": [], "wall": 0.0}
    for r in range(args.rounds):
        result = asyncio.run(_workload(url, argparse.Namespace(**{**vars(args), "seed": args.seed + r})))
        for key in ("itl", "ttft_streams", "ttft_long"):
            pooled[key] += result[key]
        pooled["wall"] += result["wall"] / args.rounds
    return pooled


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--long", type=int, default=12)
    parser.add_argument("--long-words", type=int, default=500)
    parser.add_argument("--gap", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="workloads per form, their figures pooled")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = {}
    for name, options in (
        ("colocated (2 cores, one server)", ()),
        ("colocated, prefill chunks of 128", ("--max-num-batched-tokens", "128")),
    ):
        colocated = Server(args.model, "0,1", *options)
        try:
            rows[name] = _rounds(colocated.url, args)
        finally:
            colocated.stop()
    for name, options in (
        ("disaggregated (prefill core 0, decode core 1)", ()),
        ("disaggregated, prompts under 128 tokens prefilled by decode", ("--kv-remote-min-tokens", "128")),
    ):
        prefill = Server(args.model, "0", "--kv-role", "prefill")
        decode = Server(args.model, "1", "--kv-role", "decode", "--kv-peer", prefill.url, *options)
        try:
            rows[name] = _rounds(decode.url, args)
        finally:
            decode.stop()
            prefill.stop()
    print(
        "| form | ITL p50 ms | ITL p99 ms | ITL max ms | stream TTFT p50 ms | long TTFT p50 ms "
        "| long TTFT p99 ms | wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {_pct(r['itl'], 0.5):.1f} | {_pct(r['itl'], 0.99):.1f} | {max(r['itl']) * 1000:.0f} | "
            f"{statistics.median(r['ttft_streams']) * 1000:.0f} | {_pct(r['ttft_long'], 0.5):.0f} | "
            f"{_pct(r['ttft_long'], 0.99):.0f} | {r['wall']:.1f} |"
        )


if __name__ == "__main__":
    main()
