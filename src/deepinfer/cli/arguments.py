"""Argument groups several subcommands share, each defined once: the engine's (weights,
parallelism, compilation) and the sampling flags."""

from __future__ import annotations

import argparse
import json

import torch

from deepinfer.cache import kv_dtypes
from deepinfer.cli.engine_args import COMPILE_CHOICES
from deepinfer.server.lora_modules import LoraModule, parse_lora_module

TP_HELP = (
    "ranks in worker processes the engine starts (Llama heads; MoE experts with --enable-expert-parallel)"
)
EP_HELP = "split a MoE model's routed experts over the tensor- or data-parallel ranks"
BI_HELP = "a request's logits independent of the batch it runs in (each sequence its own forward)"
REPLICAS_HELP = (
    "whole engines splitting the requests, N - 1 of them in worker processes, each on 1/N of "
    "the CPU threads (SGLang's dp_size; CPU only)"
)
DP_HELP = (
    "data-parallel attention: ranks with their own requests and KV cache "
    "(experts split and reached by all-to-all with --enable-expert-parallel)"
)
SPECULATIVE_HELP = (
    'speculative decoding, as in vLLM: \'{"method": "ngram"|"mtp"|"dspark", '
    '"num_speculative_tokens": k, "schedule": "static"|"threshold"|"hardware"}\''
)
COMPILE_HELP = (
    "compiled model step (auto: the platform's default; on the CPU, where compiling "
    "pays, saved steps, and missing ones compiled once eager steps took "
    "$DEEPINFER_CPU_COMPILE_AFTER_S, 30 s by default; 'on' compiles and saves at once)"
)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (vLLM's ``--speculative-config`` spelling)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def lora_module(text: str) -> LoraModule:
    """An argparse type: one ``--lora-modules`` entry (``name=path`` or vLLM's JSON form)."""
    try:
        return parse_lora_module(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: the benchmarks' CPU threads, this process's count by default."""
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())


def add_parallel_arguments(parser: argparse.ArgumentParser, *, replicas: bool) -> None:
    """Tensor, expert and data parallelism; ``replicas``: also whole-engine replicas (offline
    commands only)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=TP_HELP)
    parser.add_argument("--enable-expert-parallel", action="store_true", help=EP_HELP)
    parser.add_argument("--data-parallel-size", type=int, default=1, help=DP_HELP)
    if replicas:
        parser.add_argument("--data-parallel-replicas", type=int, default=1, help=REPLICAS_HELP)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """Serving LoRA adapters (vLLM's flags): the engine's limits, and ``--lora-modules``, the
    adapters served by name from the start."""
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories) per request"
    )
    parser.add_argument(
        "--max-loras", type=positive_int, default=None, help="adapters running at once (default 4)"
    )
    parser.add_argument(
        "--max-lora-rank", type=positive_int, default=None, help="highest adapter rank served (default 16)"
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="adapters kept loaded in host memory (default: --max-loras)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters served from the start, each chosen by its name as a request's model: "
        'name=path or \'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora)',
    )


def add_engine_arguments(parser: argparse.ArgumentParser, *, offline: bool) -> None:
    """The engine's options for a command that loads a model. ``offline`` (``generate``):
    also ``--data-parallel-replicas``; otherwise (``serve``, ``chat``) also ``--max-model-len``
    and ``--max-num-seqs``."""
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization",
        choices=["none", "fp8", "int8", "int4", "bf16"],
        default=None,
        help="default: as stored (fp8/fp4 stay resident); none: dequantize on load; fp8: quantize "
        "linears to fp8 blocks; int8/int4: weight-only, dense models on CPU",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *kv_dtypes.KV_CACHE_DTYPES],
        default="auto",
        help="paged K/V cache element type (vLLM's option): auto = the model's trained format or "
        "its dtype; fp8 (= fp8_e4m3) / fp8_e5m2 store values with a scale of 1, saturated",
    )
    add_parallel_arguments(parser, replicas=offline)
    parser.add_argument("--batch-invariant", action="store_true", help=BI_HELP)
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="each output carries the experts every token was routed to, per MoE layer",
    )
    if not offline:
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=None)
        parser.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="tokens one step computes at most: longer prompts are prefilled in chunks of this",
        )
    parser.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help=SPECULATIVE_HELP if offline else "as for generate",
    )
    parser.add_argument("--compile", choices=sorted(COMPILE_CHOICES), default="auto", help=COMPILE_HELP)
    add_tier_arguments(parser)


def byte_size(text: str) -> int:
    """An argparse type: bytes, as a count or with a K/M/G/T suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(body[-1:], 1)
    try:
        value = float(body[:-1] if body[-1:] in units else body) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 8G, 512M, 1073741824)"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(value)


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's host and disk tiers (``EngineConfig.kv_offload_bytes`` ...)."""
    parser.add_argument(
        "--kv-offload-bytes",
        type=byte_size,
        default=None,
        help="host memory kept for evicted prefix-cache blocks (e.g. 8G; default: none)",
    )
    parser.add_argument(
        "--kv-cache-dir",
        default=None,
        help="a directory keeping prefix-cache blocks on disk, across restarts (default: none)",
    )
    parser.add_argument(
        "--kv-disk-bytes", type=byte_size, default=None, help="the most --kv-cache-dir holds (default 16G)"
    )


def add_sampling_arguments(
    parser: argparse.ArgumentParser, *, max_tokens: int, temperature: float, full: bool
) -> None:
    """Sampling flags with this command's defaults; ``full``: also top-p, top-k and
    ``--ignore-eos``."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    if full:
        parser.add_argument("--top-p", type=float, default=1.0)
        parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    if full:
        parser.add_argument("--ignore-eos", action="store_true")
