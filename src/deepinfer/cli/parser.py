"""The ``deepinfer`` argparse tree: each subcommand's own flags, the shared groups from
``arguments``, and the handler each one runs (``args.func``)."""

from __future__ import annotations

import argparse

from deepinfer.cache import kv_dtypes
from deepinfer.cli.arguments import add_engine_arguments, add_lora_arguments, add_sampling_arguments
from deepinfer.cli.bench import add_bench_parser
from deepinfer.cli.chat import chat
from deepinfer.cli.generate import generate
from deepinfer.cli.perplexity import add_perplexity_parser
from deepinfer.cli.serve import serve
from deepinfer.cli.tools import dump_graphs, make_tiny, plan
from deepinfer.cli.train_drafter import add_train_drafter_parser
from deepinfer.server.limits import ServerLimits
from deepinfer.tiny import TINY_CONFIGS


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (no network needed)")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="deepseek_v4", choices=sorted(TINY_CONFIGS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tiny.add_argument("--quant", choices=["none", "fp8"], default="none")
    tiny.add_argument("--shards", type=int, default=1)
    tiny.set_defaults(func=make_tiny)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="weights and KV cache per device for a model and context length, from its config alone",
    )
    pl.add_argument(
        "model",
        help="a checkpoint directory, a named model, a config.json, or one of: "
        "deepseek-v4-flash, deepseek-v4.1-flash (the released configs)",
    )
    pl.add_argument("--max-model-len", type=int, required=True)
    pl.add_argument("--tensor-parallel-size", type=int, default=1)
    pl.add_argument("--memory-gib", type=float, default=None, help="memory per device (GiB)")
    pl.add_argument("--memory-utilization", type=float, default=0.9, help="share of it for weights and cache")
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *kv_dtypes.KV_CACHE_DTYPES],
        default="auto",
        help="auto: the trained precision where the model has one (fake-quant on), else bfloat16",
    )
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=plan)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline generation from a checkpoint directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    add_sampling_arguments(gen, max_tokens=32, temperature=0.0, full=True)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the chat template (the default when the "
        "checkpoint has one)",
    )
    gen.add_argument("--raw", action="store_true", help="a plain completion, without the chat template")
    add_engine_arguments(gen, offline=True)
    gen.set_defaults(func=generate)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve_ = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    serve_.add_argument("model")
    serve_.add_argument("--host", default="127.0.0.1")
    serve_.add_argument("--port", type=int, default=8000)
    serve_.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve_.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    serve_.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    limits = ServerLimits()
    serve_.add_argument(
        "--max-request-bytes", type=int, default=limits.max_request_bytes, help="larger bodies get 413"
    )
    serve_.add_argument(
        "--max-messages", type=int, default=limits.max_messages, help="chats with more messages get 400"
    )
    serve_.add_argument(
        "--prompt-timeout",
        type=float,
        default=limits.prompt_timeout_s,
        help="seconds to tokenize or render one request's prompt (off the event loop)",
    )
    serve_.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout_s,
        help="seconds to send request headers",
    )
    serve_.add_argument(
        "--body-timeout", type=float, default=limits.body_timeout_s, help="seconds to send a request body"
    )
    serve_.add_argument(
        "--shutdown-timeout",
        type=float,
        default=limits.shutdown_timeout_s,
        help="on SIGTERM, seconds running requests may finish before they are ended",
    )
    serve_.add_argument("--log-level", default="warning")
    serve_.add_argument("--no-ui", action="store_true", help="leave out the chat page at /")
    serve_.add_argument(
        "--enable-rl-endpoints",
        action="store_true",
        help="serve the control endpoints that change engine state (weight updates, sleep, "
        "pausing); off, they answer 404",
    )
    serve_.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora); "
        "off, they answer 404",
    )
    add_engine_arguments(serve_, offline=False)
    add_lora_arguments(serve_)
    add_kv_role_arguments(serve_)
    serve_.set_defaults(func=serve)


def add_kv_role_arguments(parser: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation (``deepinfer.disagg``)."""
    parser.add_argument(
        "--kv-role",
        choices=("prefill", "decode"),
        default=None,
        help="prefill: keep every prompt's blocks for a decode server to take (a host tier of 1G "
        "unless --kv-offload-bytes says otherwise); decode: take the blocks a request's "
        "kv_transfer_params names (a proxy prefilled it), or have --kv-peer prefill every prompt",
    )
    parser.add_argument("--kv-peer", default=None, help="the prefill server's URL (with --kv-role decode)")
    parser.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="the address decode servers reach this prefill server's block transfers at",
    )
    parser.add_argument(
        "--kv-transfer-port", type=int, default=0, help="its port for block transfers (0: any free one)"
    )
    parser.add_argument(
        "--kv-trusted-hosts",
        default="127.0.0.1,localhost",
        help="comma-separated prefill hosts a decode server takes blocks from (an offered block "
        "enters the shared prefix cache, so offers naming other hosts are refused)",
    )
    parser.add_argument(
        "--kv-remote-min-tokens",
        type=int,
        default=0,
        help="a decode server prefills prompts shorter than this itself (default 0: the peer "
        "prefills every prompt)",
    )
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill or a block transfer may take before the decode server computes the prompt",
    )


def _add_chat(sub: argparse._SubParsersAction) -> None:
    chat_ = sub.add_parser("chat", help="a terminal chat with a model (its chat format)")
    chat_.add_argument("model")
    chat_.add_argument("--system", default=None, help="a system message")
    chat_.add_argument(
        "--no-thinking", action="store_true", help="DeepSeek-V4: answer without reasoning first"
    )
    add_sampling_arguments(chat_, max_tokens=256, temperature=0.7, full=False)
    add_engine_arguments(chat_, offline=False)
    chat_.set_defaults(func=chat)


def _add_dump_graphs(sub: argparse._SubParsersAction) -> None:
    dump = sub.add_parser("dump-graphs", help="write the tiny models' compiled graphs (fx_graphs/)")
    dump.add_argument("--out", default="fx_graphs")
    dump.add_argument("--arch", action="append", choices=["deepseek_v4", "deepseek_v41", "llama"])
    dump.set_defaults(func=dump_graphs)


def build_parser() -> argparse.ArgumentParser:
    """The whole tree; ``parse_args`` leaves the subcommand's handler in ``args.func``."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-class inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny(sub)
    _add_plan(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_chat(sub)
    add_bench_parser(sub)
    add_perplexity_parser(sub, add_engine_arguments)
    _add_dump_graphs(sub)
    add_train_drafter_parser(sub)
    return parser
