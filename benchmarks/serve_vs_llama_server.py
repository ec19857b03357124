"""``deepinfer serve`` against llama.cpp's ``llama-server`` on the same SmolLM2 weights (F32
GGUF converted from our converted directory), with ``deepinfer bench serve`` at several
concurrencies. llama-server gets as many slots as the highest concurrency
(``--parallel``, each slot with a context of prompt + output) and 2 threads, as we use.

Run: ``python benchmarks/serve_vs_llama_server.py --llama-server BIN --gguf FILE``; the GGUF
comes from llama.cpp's ``convert_hf_to_gguf.py DIR --outtype f32`` (``docs/benchmarks.md``, "Building the llama.cpp peer").
"""

from __future__ import annotations

import argparse

from serve_vs_transformers import bench, bench_ours, print_table, serve, stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    slots = max(args.concurrency)
    theirs_url = "http://127.0.0.1:8102"
    results = {}
    results["deepinfer"] = bench_ours(args.concurrency, args.input_len, args.output_len)
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
    print_table(results, args.concurrency)


if __name__ == "__main__":
    main()
