"""``deepinfer bench``'s subcommands: their flags here, what they run in
``deepinfer.bench.commands``."""

from __future__ import annotations

import argparse

from deepinfer.bench import commands
from deepinfer.cli.arguments import add_parallel_arguments, add_threads_argument, positive_int
from deepinfer.cli.engine_args import llm_kwargs

# bench.llama_cpp.VARIANTS' names (kept here so the parser builds without importing the engine)
BATCHED_VARIANTS = ("fp32", "fp32-kv16", "fp32-kv8", "fp32-kvi8", "bf16", "int8", "int4")


def _throughput(args: argparse.Namespace) -> int:
    """``bench throughput`` with the engine options its flags give."""
    return commands.throughput(args, llm_kwargs(args))


def _add_throughput(bench_sub: argparse._SubParsersAction) -> None:
    tp = bench_sub.add_parser("throughput", help="offline throughput of N random requests")
    tp.add_argument("--model", default=None, help="checkpoint dir (default: a tiny V4 built on the fly)")
    tp.add_argument("--num-requests", type=int, default=256)
    tp.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--max-num-seqs", type=int, default=256)
    tp.add_argument("--max-num-batched-tokens", type=int, default=2048)
    tp.add_argument("--peer-batch-sizes", type=int, nargs="*", default=[64, 256])
    add_threads_argument(tp)
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="alternate deepinfer and the peer this many times and report the median ratio "
        "(for machines whose speed drifts within a run)",
    )
    add_parallel_arguments(tp, replicas=True)
    tp.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="compiled model step (auto: the platform's default); compiled runs warm up first",
    )
    tp.set_defaults(func=_throughput)


def _add_latency(bench_sub: argparse._SubParsersAction) -> None:
    lat = bench_sub.add_parser("latency", help="TTFT and time per output token at several concurrencies")
    lat.add_argument("--model", default="smollm2-135m")
    lat.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    lat.add_argument("--prompt-len", type=int, default=64)
    lat.add_argument("--output-len", type=int, default=32)
    add_threads_argument(lat)
    lat.add_argument("--plot", default=None, help="write a PNG of tok/s against concurrency here")
    lat.set_defaults(func=commands.latency)


def _add_batched(bench_sub: argparse._SubParsersAction) -> None:
    bb = bench_sub.add_parser(
        "batched",
        help="llama-batched-bench's shape (B prompts, fixed output), against llama.cpp on the same weights",
    )
    bb.add_argument("--model", default="smollm2-135m", help="a dense (Llama-family) checkpoint")
    bb.add_argument(
        "--llama-cpp",
        default=None,
        help="a built llama.cpp checkout (build/bin/llama-batched-bench); default $LLAMA_CPP_DIR, "
        "else no peer",
    )
    bb.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    bb.add_argument(
        "--variants",
        nargs="+",
        default=["fp32", "fp32-kv16", "int8", "int4"],
        choices=list(BATCHED_VARIANTS),
    )
    bb.add_argument("--prompt-len", type=int, default=144)
    bb.add_argument("--output-len", type=int, default=64)
    add_threads_argument(bb)
    bb.set_defaults(func=commands.batched)


def _add_serve(bench_sub: argparse._SubParsersAction) -> None:
    bs = bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server, print vllm bench serve's figures"
    )
    bs.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    bs.add_argument("--model", required=True, help="the name the server serves")
    bs.add_argument("--dataset", choices=["random", "chat"], default="random")
    bs.add_argument("--num-prompts", type=int, default=64)
    bs.add_argument("--input-len", type=int, default=128, help="random dataset: words per prompt")
    bs.add_argument("--output-len", type=int, default=64)
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (fixed output lengths)")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--json", default=None, help="also write the figures to this file")
    bs.set_defaults(func=commands.serve)


def _add_startup(bench_sub: argparse._SubParsersAction) -> None:
    st = bench_sub.add_parser("startup", help="time from process start to the first token, per engine")
    st.add_argument("--model", default="smollm2-135m")
    st.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="deepinfer's compiled step (auto: default)",
    )
    st.set_defaults(func=commands.startup)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``bench`` and its subcommands under the top-level ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks against transformers on the same weights")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _add_throughput(bench_sub)
    _add_latency(bench_sub)
    _add_batched(bench_sub)
    _add_serve(bench_sub)
    _add_startup(bench_sub)
