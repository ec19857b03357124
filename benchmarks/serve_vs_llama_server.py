"""``deepinfer serve`` against llama.cpp's ``llama-server`` on the same SmolLM2 weights (F32
GGUF converted from our converted directory), with ``deepinfer bench serve`` at several
concurrencies (issue 17). llama-server gets as many slots as the highest concurrency
(``--parallel``, each slot with a context of prompt + output) and 2 threads, as we use.

Run: ``python benchmarks/serve_vs_llama_server.py --llama-server BIN --gguf FILE``; the GGUF
comes from llama.cpp's ``convert_hf_to_gguf.py DIR --outtype f32`` (``../shared/reference/cpu_peers.md``).
"""

from __future__ import annotations

import argparse
import sys

from serve_vs_transformers import bench, serve, stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    slots = max(args.concurrency)
    ours_url, theirs_url = "http://127.0.0.1:8100", "http://127.0.0.1:8102"
    results = {}
    proc = serve(
        [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "serve",
            "smollm2-135m",
            "--port",
            "8100",
            "--max-num-seqs",
            "64",
        ],
        ours_url,
    )
    try:
        results["deepinfer"] = bench(
            ours_url, "smollm2-135m", args.concurrency, args.input_len, args.output_len
        )
    finally:
        stop(proc)
    ctx = slots * (2 * args.input_len + args.output_len + 64)
    cmd = [
        args.llama_server,
        "-m",
        args.gguf,
        "--port",
        "8102",
        "-t",
        "2",
        "-tb",
        "2",
        "--parallel",
        str(slots),
        "-c",
        str(ctx),
    ]
    proc = serve(cmd, theirs_url)
    try:
        results["llama-server"] = bench(theirs_url, "smol", args.concurrency, args.input_len, args.output_len)
    finally:
        stop(proc)
    print(
        "| concurrency | requests | deepinfer out tok/s | llama-server out tok/s | ratio | deepinfer TTFT / TPOT median (ms) | llama-server TTFT / TPOT median (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        a, b = results["deepinfer"][c], results["llama-server"][c]
        ratio = (
            a["output_token_throughput"] / b["output_token_throughput"]
            if b["output_token_throughput"]
            else float("inf")
        )
        print(
            f"| {c} | {a['successful_requests']}/{b['successful_requests']} | {a['output_token_throughput']:.1f} | "
            f"{b['output_token_throughput']:.1f} | {ratio:.2f}x | {a['ttft_ms']['median']:.0f} / {a['tpot_ms']['median']:.1f} | "
            f"{b['ttft_ms']['median']:.0f} / {b['tpot_ms']['median']:.1f} |"
        )
        for name, r in (("deepinfer", a), ("llama-server", b)):
            if r["errors"]:
                print(f"  {name} errors at c={c}: {r['errors']}")


if __name__ == "__main__":
    main()
