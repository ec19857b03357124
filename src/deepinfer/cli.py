"""``deepinfer`` command line: ``make-tiny``, ``plan``, ``generate``, ``serve``, ``chat``,
``bench throughput|latency|batched|serve|startup`` and ``dump-graphs``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from deepinfer.cache import kv_dtypes
from deepinfer.server.limits import ServerLimits
from deepinfer.tiny import TINY_CONFIGS


def _make_tiny(args: argparse.Namespace) -> int:
    from deepinfer.tiny import make_tiny_checkpoint

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    quant = None if args.quant == "none" else args.quant
    path = make_tiny_checkpoint(
        args.path, arch=args.arch, seed=args.seed, dtype=dtype, quant=quant, shards=args.shards
    )
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from deepinfer.engine.memory import GIB, format_plan, plan
    from deepinfer.models.registry import load_config_json, resolve
    from deepinfer.models.released_configs import RELEASED_CONFIGS
    from deepinfer.weights.catalog import resolve_model

    source = args.model
    if source in RELEASED_CONFIGS:
        raw = RELEASED_CONFIGS[source]
    elif Path(source).is_file():
        raw = json.loads(Path(source).read_text())
    else:
        raw = load_config_json(resolve_model(source))
    cfg, cls = resolve(raw)
    with torch.device("meta"):
        model = cls(cfg)
    quantization = getattr(cfg, "quantization", None) or raw.get("quantization_config")
    result = plan(
        model,
        quantization,
        args.max_model_len,
        name=source,
        tensor_parallel_size=args.tensor_parallel_size,
        memory_bytes=None if args.memory_gib is None else int(args.memory_gib * GIB),
        utilization=args.memory_utilization,
        block_size=args.block_size,
        kv_dtype=kv_dtypes.pool_dtype(args.kv_cache_dtype, torch.bfloat16),
        packed_kv=args.kv_cache_dtype == "auto",
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object (vLLM's ``--speculative-config`` spelling)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_COMPILE_CHOICES = {"auto": None, "on": True, "off": False}
# bench.llama_cpp.VARIANTS' names (kept here so the parser builds without importing the engine)
_BATCHED_VARIANTS = ("fp32", "fp32-kv16", "fp32-kv8", "bf16", "int8", "int4")


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        compile=_COMPILE_CHOICES[args.compile],
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=args.data_parallel_size,
        data_parallel_replicas=args.data_parallel_replicas,
        batch_invariant=args.batch_invariant,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.chat and args.raw:
        raise ValueError("give --chat or --raw, not both")
    # as llama.cpp's CLI does: an instruct model's prompt goes through its chat template
    chat = args.chat or (not args.raw and getattr(llm.tokenizer, "chat_template", None) is not None)
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        for out, p in zip(outputs, args.prompt, strict=True):
            out.prompt = p
    else:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"prompt: {out.prompt!r}" + ("  (chat template)" if chat else ""))
        print(f"  tokens: {completion.token_ids}")
        print(f"  text:   {completion.text!r}  ({completion.finish_reason})")
    # figures about the run, not its answers: on stderr, so stdout is the answers alone
    print(f"{generated} tokens in {elapsed:.3f}s: {generated / elapsed:.1f} tokens/s", file=sys.stderr)
    spec = llm.engine.spec
    if spec is not None:
        s = spec.stats
        print(
            f"speculative ({spec.config.method}): {s.drafted} drafted, {s.accepted} accepted, "
            f"mean acceptance length {s.mean_acceptance_length:.2f}, "
            f"{s.verified_tokens_per_step:.2f} verified tokens per step",
            file=sys.stderr,
        )
    return 0


def round_workload(args: argparse.Namespace, vocab_size: int, round_: int):
    """Round ``round_``'s requests for ``bench throughput``: the same for both sides, new prompts
    each round (a rerun of the same prompts would hit our prefix cache, which the peer lacks).
    Round 0 is ``--seed``'s workload; the warm-up uses ``--seed + 1``."""
    from deepinfer.bench.workloads import random_workload

    seed = args.seed + 1000 * round_
    return random_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, seed=seed
    )


def _bench_throughput(args: argparse.Namespace) -> int:
    import statistics
    import tempfile
    from pathlib import Path

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
        llm = LLM(
            path,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            compile=_COMPILE_CHOICES[args.compile],
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            data_parallel_size=args.data_parallel_size,
            data_parallel_replicas=args.data_parallel_replicas,
        )
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
        llm.close()
        if peer_processes is not None:
            peer_processes.close()
    return 0


_STARTUP_SCRIPT = """
import sys, time
t0 = time.perf_counter()
kind, model, compile_step = sys.argv[1], sys.argv[2], {"on": True, "off": False, "auto": None}[sys.argv[3]]
import torch
if kind == "deepinfer":
    from deepinfer import LLM, SamplingParams
    llm = LLM(model, compile=compile_step)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
else:
    from deepinfer.bench.workloads import load_transformers_peer
    from deepinfer.weights.catalog import resolve_model
    peer = load_transformers_peer(resolve_model(model))
    with torch.no_grad():
        peer.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=1)
from deepinfer.bench.workloads import peak_rss_mib
print(time.perf_counter() - t0, peak_rss_mib())
"""


def _bench_startup(args: argparse.Namespace) -> int:
    """Time from process start to the first token, cold (fresh process, twice) per engine. With
    ``--compile on`` deepinfer's first process compiles and saves its step, the second loads it."""
    import subprocess

    for kind in ("deepinfer", "transformers"):
        for attempt in ("first", "second"):
            out = subprocess.run(
                [sys.executable, "-c", _STARTUP_SCRIPT, kind, args.model, args.compile],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            print(
                f"{kind:12s} {attempt} process: {float(out[0]):.2f}s to first token, peak RSS {float(out[1]):.0f} MiB"
            )
    return 0


def _bench_batched(args: argparse.Namespace) -> int:
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


def _bench_latency(args: argparse.Namespace) -> int:
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
        from pathlib import Path

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name in ("deepinfer", "transformers"):
            xs = [c for n, c, _ in rows if n == name]
            ys = [r["tok_s"] for n, _, r in rows if n == name]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{Path(str(args.model)).name}: output tokens/s (prefill + decode)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
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


def _dump_graphs(args: argparse.Namespace) -> int:
    from deepinfer.compile.graph_dump import GRAPH_ARCHS, dump_graphs

    for path in dump_graphs(Path(args.out), tuple(args.arch or GRAPH_ARCHS)):
        print(path)
    return 0


def _engine_options(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "device": args.device,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config,
        "compile": _COMPILE_CHOICES[args.compile],
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "data_parallel_size": args.data_parallel_size,
        "batch_invariant": args.batch_invariant,
        **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
    }


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from deepinfer.server.app import build_app
        from deepinfer.server.http_protocol import header_timeout_protocol
    except ImportError as exc:
        raise ValueError(f"serve needs the serve extra: pip install 'deepinfer[serve]' ({exc})") from exc
    from deepinfer import LLM
    from deepinfer.compile.gc_heap import freeze_long_lived

    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_messages=args.max_messages,
        prompt_timeout_s=args.prompt_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    llm = LLM(args.model, **_engine_options(args))
    # the model's objects live as long as the server: out of the collector's full passes,
    # which would otherwise walk them all while every request waits (gc_heap.py)
    freeze_long_lived()
    name = args.served_model_name or args.model
    app = build_app(
        llm,
        name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        engine_thread=False,
        limits=limits,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=header_timeout_protocol(limits.header_timeout_s),
        # our own drain ends every response within shutdown_timeout_s; this is the backstop
        timeout_graceful_shutdown=int(limits.shutdown_timeout_s) + 5,
    )
    web = uvicorn.Server(config)
    engine = app.state.server.engine
    # HTTP on a background thread, the engine loop here: the thread that loaded the model
    # drives its kernels (AsyncLLM.run_here says why)
    http = threading.Thread(target=web.run, name="deepinfer-http", daemon=True)
    http.start()

    def graceful(signum: int, _frame: object) -> None:
        """SIGTERM / Ctrl-C: stop accepting, let running requests finish within the grace
        period (then end them with an error event), exit. A second signal exits at once."""
        if engine.shutting_down:
            raise KeyboardInterrupt
        web.should_exit = True
        engine.begin_shutdown(limits.shutdown_timeout_s)

    signal.signal(signal.SIGTERM, graceful)
    signal.signal(signal.SIGINT, graceful)
    print(f"deepinfer serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    try:
        engine.run_here(until=lambda: not http.is_alive() or engine.drained)
    except KeyboardInterrupt:  # a second signal: no more waiting
        pass
    web.should_exit = True
    try:
        http.join(timeout=limits.shutdown_timeout_s + 10)
    except KeyboardInterrupt:
        pass
    return 0


def _chat(args: argparse.Namespace) -> int:
    """A terminal chat: each reply streams as it is generated."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.chat import ChatOptions

    llm = LLM(args.model, **_engine_options(args))
    options = ChatOptions(thinking=False) if args.no_thinking else ChatOptions()
    parser = llm.chat_format.reply_parser(False, options)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    print("deepinfer chat: type a message, an empty line or Ctrl-D to quit", flush=True)
    while True:
        try:
            text = input("> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        ids = llm.chat_format.encode(messages, options=options)
        reply = ""
        for out in llm.stream({"prompt_token_ids": ids}, params):
            piece = out.outputs[0].text
            reply += piece
            print(piece, end="", flush=True)
        print(flush=True)
        if parser is None:
            messages.append({"role": "assistant", "content": reply})
        else:  # history keeps the answer; the format drops old reasoning anyway
            parsed = parser.parse(reply, True)
            messages.append(
                {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}
            )
    return 0


_TP_HELP = (
    "ranks in worker processes the engine starts (Llama heads; MoE experts with --enable-expert-parallel)"
)
_EP_HELP = "split a MoE model's routed experts over the tensor- or data-parallel ranks"
_BI_HELP = "a request's logits independent of the batch it runs in (each sequence its own forward)"
_REPLICAS_HELP = (
    "whole engines splitting the requests, N - 1 of them in worker processes, each on 1/N of "
    "the CPU threads (SGLang's dp_size; CPU only)"
)
_DP_HELP = (
    "data-parallel attention: ranks with their own requests and KV cache "
    "(experts split and reached by all-to-all with --enable-expert-parallel)"
)


def _add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *kv_dtypes.KV_CACHE_DTYPES],
        default="auto",
        help="paged K/V cache element type (vLLM's option): auto = the model's trained format or "
        "its dtype; fp8 (= fp8_e4m3) / fp8_e5m2 store values with a scale of 1, saturated",
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization",
        choices=["none", "fp8", "int8", "int4"],
        default=None,
        help="default: as stored (fp8/fp4 stay resident); none: dequantize on load; fp8: quantize "
        "linears to fp8 blocks; int8/int4: weight-only, dense models on CPU",
    )
    parser.add_argument("--device", default="cpu")
    _add_kv_cache_dtype(parser)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=_TP_HELP)
    parser.add_argument("--enable-expert-parallel", action="store_true", help=_EP_HELP)
    parser.add_argument("--data-parallel-size", type=int, default=1, help=_DP_HELP)
    parser.add_argument("--batch-invariant", action="store_true", help=_BI_HELP)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--speculative-config", type=_json_object, default=None, help="as for generate")
    parser.add_argument(
        "--compile",
        choices=sorted(_COMPILE_CHOICES),
        default="auto",
        help="compiled model step (auto: the platform's default; on the CPU, where compiling "
        "pays, saved steps, and missing ones compiled once eager steps took "
        "$DEEPINFER_CPU_COMPILE_AFTER_S, 30 s by default; 'on' compiles and saves at once)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-class inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (no network needed)")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="deepseek_v4", choices=sorted(TINY_CONFIGS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tiny.add_argument("--quant", choices=["none", "fp8"], default="none")
    tiny.add_argument("--shards", type=int, default=1)
    tiny.set_defaults(func=_make_tiny)

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
    pl.set_defaults(func=_plan)

    gen = sub.add_parser("generate", help="offline generation from a checkpoint directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the chat template (the default when the "
        "checkpoint has one)",
    )
    gen.add_argument("--raw", action="store_true", help="a plain completion, without the chat template")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument(
        "--quantization",
        choices=["none", "fp8", "int8", "int4"],
        default=None,
        help="default: as stored (fp8/fp4 stay resident); none: dequantize on load; fp8: quantize "
        "linears to fp8 blocks; int8/int4: weight-only, dense models on CPU",
    )
    gen.add_argument("--device", default="cpu")
    _add_kv_cache_dtype(gen)
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help=_TP_HELP)
    gen.add_argument("--enable-expert-parallel", action="store_true", help=_EP_HELP)
    gen.add_argument("--data-parallel-size", type=int, default=1, help=_DP_HELP)
    gen.add_argument("--data-parallel-replicas", type=int, default=1, help=_REPLICAS_HELP)
    gen.add_argument("--batch-invariant", action="store_true", help=_BI_HELP)
    gen.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, as in vLLM: \'{"method": "ngram"|"mtp"|"dspark", '
        '"num_speculative_tokens": k, "schedule": "static"|"threshold"|"hardware"}\'',
    )
    gen.add_argument(
        "--compile",
        choices=sorted(_COMPILE_CHOICES),
        default="auto",
        help="compiled model step (auto: the platform's default; on the CPU, where compiling "
        "pays, saved steps, and missing ones compiled once eager steps took "
        "$DEEPINFER_CPU_COMPILE_AFTER_S, 30 s by default; 'on' compiles and saves at once)",
    )
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    serve.add_argument("model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    serve.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    limits = ServerLimits()
    serve.add_argument(
        "--max-request-bytes", type=int, default=limits.max_request_bytes, help="larger bodies get 413"
    )
    serve.add_argument(
        "--max-messages", type=int, default=limits.max_messages, help="chats with more messages get 400"
    )
    serve.add_argument(
        "--prompt-timeout",
        type=float,
        default=limits.prompt_timeout_s,
        help="seconds to tokenize or render one request's prompt (off the event loop)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout_s,
        help="seconds to send request headers",
    )
    serve.add_argument(
        "--body-timeout", type=float, default=limits.body_timeout_s, help="seconds to send a request body"
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=limits.shutdown_timeout_s,
        help="on SIGTERM, seconds running requests may finish before they are ended",
    )
    serve.add_argument("--log-level", default="warning")
    _add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    chat = sub.add_parser("chat", help="a terminal chat with a model (its chat format)")
    chat.add_argument("model")
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument(
        "--no-thinking", action="store_true", help="DeepSeek-V4: answer without reasoning first"
    )
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--seed", type=int, default=None)
    _add_engine_arguments(chat)
    chat.set_defaults(func=_chat)

    bench = sub.add_parser("bench", help="benchmarks against transformers on the same weights")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput of N random requests")
    tp.add_argument("--model", default=None, help="checkpoint dir (default: a tiny V4 built on the fly)")
    tp.add_argument("--num-requests", type=int, default=256)
    tp.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--max-num-seqs", type=int, default=256)
    tp.add_argument("--max-num-batched-tokens", type=int, default=2048)
    tp.add_argument("--peer-batch-sizes", type=int, nargs="*", default=[64, 256])
    tp.add_argument("--threads", type=int, default=torch.get_num_threads())
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="alternate deepinfer and the peer this many times and report the median ratio "
        "(for machines whose speed drifts within a run)",
    )
    tp.add_argument("--tensor-parallel-size", type=int, default=1, help=_TP_HELP)
    tp.add_argument("--enable-expert-parallel", action="store_true", help=_EP_HELP)
    tp.add_argument("--data-parallel-size", type=int, default=1, help=_DP_HELP)
    tp.add_argument("--data-parallel-replicas", type=int, default=1, help=_REPLICAS_HELP)
    tp.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="compiled model step (auto: the platform's default); compiled runs warm up first",
    )
    tp.set_defaults(func=_bench_throughput)

    lat = bench_sub.add_parser("latency", help="TTFT and time per output token at several concurrencies")
    lat.add_argument("--model", default="smollm2-135m")
    lat.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    lat.add_argument("--prompt-len", type=int, default=64)
    lat.add_argument("--output-len", type=int, default=32)
    lat.add_argument("--threads", type=int, default=torch.get_num_threads())
    lat.add_argument("--plot", default=None, help="write a PNG of tok/s against concurrency here")
    lat.set_defaults(func=_bench_latency)

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
        choices=list(_BATCHED_VARIANTS),
    )
    bb.add_argument("--prompt-len", type=int, default=144)
    bb.add_argument("--output-len", type=int, default=64)
    bb.add_argument("--threads", type=int, default=torch.get_num_threads())
    bb.set_defaults(func=_bench_batched)

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
    bs.set_defaults(func=_bench_serve)

    dump = sub.add_parser("dump-graphs", help="write the tiny models' compiled graphs (fx_graphs/)")
    dump.add_argument("--out", default="fx_graphs")
    dump.add_argument("--arch", action="append", choices=["deepseek_v4", "deepseek_v41", "llama"])
    dump.set_defaults(func=_dump_graphs)

    st = bench_sub.add_parser("startup", help="time from process start to the first token, per engine")
    st.add_argument("--model", default="smollm2-135m")
    st.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="deepinfer's compiled step (auto: default)",
    )
    st.set_defaults(func=_bench_startup)
    return parser


def _follow(args: argparse.Namespace, rank: int, size: int) -> NoReturn:
    """A torchrun rank other than 0: load this rank's share and run the steps rank 0 sends."""
    from deepinfer.distributed.workers import worker_main
    from deepinfer.llm import parse_dtype
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.models.registry import load_config_json, resolve
    from deepinfer.weights.catalog import resolve_model

    path = resolve_model(args.model)
    _, cls = resolve(load_config_json(path))
    if args.data_parallel_size > 1:
        mode = "data+ep" if args.enable_expert_parallel else "data"
    else:
        mode = (
            "llama"
            if cls is LlamaForCausalLM
            else "deepseek+ep"
            if args.enable_expert_parallel
            else "deepseek"
        )
    load_kwargs = {
        "path": str(path),
        "dtype": parse_dtype(args.dtype),
        "device": args.device,
        "fake_quant": None,
        "keep_quantized": args.quantization in (None, "fp8"),
    }
    worker_main(rank, size, None, mode, load_kwargs)
    # Leave without running C++ static destructors: after a gloo group, one of PyTorch's can
    # destroy a still-joinable thread and abort the process (3 of 5 test runs here), which
    # torchrun reports as a failed rank. multiprocessing workers exit this way too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ranks_from_torchrun(args: argparse.Namespace) -> tuple[int, int] | None:
    """Under torchrun with several ranks: (rank, world size), the command's
    ``--tensor-parallel-size`` (or, when it asks for data parallel, ``--data-parallel-size``)
    set to the world size or checked against it."""
    from deepinfer.distributed.workers import launched_by_torchrun

    ranks = launched_by_torchrun()
    if ranks is None:
        return None
    if getattr(args, "tensor_parallel_size", None) is None or getattr(args, "model", None) is None:
        raise ValueError(
            f"'{args.command}' does not run across torchrun ranks (generate, serve and chat do, with a model)"
        )
    if args.data_parallel_size > 1:
        if args.data_parallel_size * args.tensor_parallel_size != ranks[1]:
            raise ValueError(
                f"--data-parallel-size {args.data_parallel_size} x --tensor-parallel-size "
                f"{args.tensor_parallel_size} but torchrun started {ranks[1]} ranks"
            )
    elif args.tensor_parallel_size == 1:
        args.tensor_parallel_size = ranks[1]
    elif args.tensor_parallel_size != ranks[1]:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size} but torchrun started {ranks[1]} ranks"
        )
    return ranks


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ranks = _ranks_from_torchrun(args)
        if ranks is not None and ranks[0] != 0:
            return _follow(args, *ranks)
        return args.func(args)
    except ValueError as exc:  # bad input: say what is wrong, no traceback
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
