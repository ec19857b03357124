"""llama.cpp's ``llama-batched-bench`` shape, run on deepinfer and, when a built llama.cpp is
given, on llama.cpp in the same run from the same weights (``deepinfer bench batched``).

B sequences of P-token prompts, N output tokens each; per B: prefill tok/s (``S_PP``), decode
tok/s (``S_TG``) and the whole shape's output tok/s (B x N / wall), as llama-batched-bench
reports them. Variants pair a deepinfer setting with the llama.cpp type converted from the same
checkpoint: our exact fp32 and fp32 with an fp16 KV cache (llama.cpp's own default KV
precision) against F32, fp32 with an fp8 KV cache against F32 with llama.cpp's 8-bit (q8_0) KV
cache, bf16 weights against BF16, weight-only int8 against Q8_0, int4 against
Q4_0. The prefix cache is off: llama-batched-bench prefills every prompt, so a cache hit would
be work the peer pays for. The CPU's ISA (and the oneDNN kernel our bf16 projections run above
a few rows: AMX or not) is printed with the table, so figures from different machines are never
compared as if alike; quantized variants report greedy agreement with our fp32 on chat prompts.

The llama.cpp peer is a built checkout (``--llama-cpp``, or ``$LLAMA_CPP_DIR``) with
``build/bin/llama-batched-bench`` and ``llama-quantize``; its converter needs ``gguf``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from deepinfer.bench.serve import CHAT_PROMPTS
from deepinfer.kernels import weight_only
from deepinfer.kernels.cpu import int4_vnni as cpu_int4_vnni
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

# deepinfer's engine options and the llama.cpp type of the same weights (None: no peer)
VARIANTS: dict[str, tuple[dict, str | None]] = {
    "fp32": ({}, "F32"),
    "fp32-kv16": ({"kv_cache_dtype": "float16"}, "F32"),
    "fp32-kv8": ({"kv_cache_dtype": "fp8"}, "F32"),
    "fp32-kvi8": ({"kv_cache_dtype": "int8"}, "F32"),
    "bf16": ({"dtype": "bfloat16"}, "BF16"),
    "int8": ({"quantization": "int8"}, "Q8_0"),
    "int4": ({"quantization": "int4"}, "Q4_0"),
}
# llama.cpp's K/V cache type for a variant (else its default, f16): an 8-bit cache against ours
PEER_CACHE_TYPES = {"fp32-kv8": "q8_0", "fp32-kvi8": "q8_0"}
# (prefill tok/s, decode tok/s, output tok/s of the whole shape)
Row = tuple[float, float, float]
# llama.cpp's own converter writes these types; the rest come from llama-quantize
CONVERTER_TYPES = ("F32", "BF16", "Q8_0")
# llama.cpp's flag that keeps weights in the model file's layout (no repacking into its AVX or
# AMX buffers), the fallback when its repacked path crashes (ggml-org/llama.cpp#20824: a
# segfault in ggml_backend_amx_mul_mat, which Q8_0 weights reach on CPUs with AMX)
NO_REPACK = "--no-repack"


class PeerRows(NamedTuple):
    """llama.cpp's rows by batch size, and the fallback flag it needed (None: its defaults)."""

    rows: dict[int, Row]
    fallback: str | None


def cpu_description() -> str:
    """The CPU's model, its vector extensions that matter here and PyTorch's pick."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags: set[str] = set()
    model = "?"
    for line in text.splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
    have = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags
    ]
    return (
        f"{model}; {' '.join(have) or 'no AVX2 or AVX-512'}; torch capability "
        f"{torch.backends.cpu.get_cpu_capability()}; int4 x int8 kernel: {cpu_int4_vnni.isa()}; "
        f"bf16 projections: cpu_packed_gemm up to {weight_only.BF16_PACKED_ROWS} rows, above "
        f"{weight_only.onednn_bf16_kernel() or 'not oneDNN'}"
    )


def batched_bench(llm: LLM, batch: int, prompt_len: int, output_len: int) -> Row:
    """One llama-batched-bench row on ``llm``: ``batch`` distinct prompts at once."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    vocab = llm.vocab_size
    base, span = (100, min(40000, vocab - 100)) if vocab > 200 else (0, vocab)  # clear of special ids
    prompts = [[(7 * i + 13 * j) % span + base for j in range(prompt_len)] for i in range(batch)]
    tag = time.perf_counter_ns()
    reqs = [engine.add_request(f"b{batch}-{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    prefilled = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    for r in reqs:
        engine.pop_finished(r.request_id)
    return (
        batch * prompt_len / (prefilled - start),
        batch * (output_len - 1) / (end - prefilled),
        batch * output_len / (end - start),
    )


def agreement(reference: LLM, other: LLM, prompts: int = 8, tokens: int = 32) -> tuple[float, float]:
    """(share of greedy tokens equal to ``reference``'s before the first divergence; mean
    |logprob difference| of the first token's top-5 under ``reference``) on chat prompts."""
    tokenizer = other.tokenizer
    assert tokenizer is not None
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        if getattr(tokenizer, "chat_template", None)
        else q  # a checkpoint without a chat template gets the questions as they are
        for q in CHAT_PROMPTS[:prompts]
    ]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    ref = reference.generate(texts, params, use_tqdm=False)
    got = other.generate(texts, params, use_tqdm=False)
    same, errors = 0, []
    for a, b in zip(ref, got, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        errors += [abs(first_a[t].logprob - first_b[t].logprob) for t in first_a if t in first_b]
    return same / (tokens * len(texts)), sum(errors) / max(len(errors), 1)


def parse_batched_bench(output: str, output_len: int) -> dict[int, Row]:
    """llama-batched-bench's markdown table -> {B: (S_PP, S_TG, B x output_len / T)}; its
    columns: PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[2] or ""):
            b = int(cells[2])
            rows[b] = (float(cells[5]), float(cells[7]), b * output_len / float(cells[8]))
    return rows


def _prepare(run: Callable[..., subprocess.CompletedProcess], args: list[str]) -> None:
    """Run one of llama.cpp's weight tools; when it fails, say which and show the end of what
    it printed (a missing Python package of its converter, say) instead of only its exit code."""
    try:
        run(args, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        tail = "\n".join(((error.stderr or "") + (error.stdout or "")).strip().splitlines()[-5:])
        tool = Path(args[1] if args[0] == sys.executable else args[0]).name
        raise RuntimeError(f"llama.cpp's {tool} failed (exit {error.returncode}):\n{tail}") from error


def peer_gguf(
    root: Path,
    checkpoint: Path,
    outtype: str,
    folder: Path,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> Path:
    """``checkpoint`` converted to llama.cpp's ``outtype`` in ``folder`` by the checkout's own
    converter (types it does not write: from its F32 file by ``llama-quantize``)."""
    gguf = folder / f"model-{outtype.lower()}.gguf"
    if gguf.exists():
        return gguf
    convert = [sys.executable, str(root / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile"]
    if outtype in CONVERTER_TYPES:
        _prepare(run, [*convert, str(gguf), "--outtype", outtype.lower()])
    else:
        base = peer_gguf(root, checkpoint, "F32", folder, run)
        _prepare(run, [str(root / "build" / "bin" / "llama-quantize"), str(base), str(gguf), outtype])
    return gguf


def llama_cpp_rows(
    root: Path,
    checkpoint: Path,
    outtype: str,
    batches: list[int],
    prompt_len: int,
    output_len: int,
    threads: int,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    cache_type: str | None = None,
) -> PeerRows:
    """llama-batched-bench on ``checkpoint`` converted to ``outtype`` (F32, BF16, Q8_0 or Q4_0) by
    the checkout's own converter (and ``llama-quantize`` for Q4_0). Run with llama.cpp's
    defaults; only when that run dies of a signal is it rerun once with ``--no-repack`` (and the
    result says so), so a crash in one of its kernels costs the table a weaker peer, not the run.
    ``cache_type``: its K and V cache type (``-ctk``/``-ctv``; a quantized V cache needs its
    flash attention, turned on with it)."""
    bench = root / "build" / "bin" / "llama-batched-bench"
    if not bench.exists():
        raise FileNotFoundError(f"--llama-cpp: no {bench} (build llama.cpp there first)")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = peer_gguf(root, checkpoint, outtype, Path(tmp), run)
        context = max(batches) * (prompt_len + output_len) + 64
        args = [str(bench), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512"]
        args += ["-npp", str(prompt_len), "-ntg", str(output_len), "-npl", ",".join(map(str, batches))]
        args += ["-t", str(threads), "-tb", str(threads)]
        if cache_type is not None:
            args += ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"]
        try:
            out, fallback = run(args, check=True, capture_output=True, text=True).stdout, None
        except subprocess.CalledProcessError as error:
            if error.returncode >= 0:  # an error it reported, not a crash: nothing to fall back to
                raise
            out, fallback = (
                run([*args, NO_REPACK], check=True, capture_output=True, text=True).stdout,
                NO_REPACK,
            )
    return PeerRows(parse_batched_bench(out, output_len), fallback)


def run_table(
    model: str | Path,
    variants: list[str],
    batches: list[int],
    llama_cpp: Path | None = None,
    prompt_len: int = 144,
    output_len: int = 64,
    threads: int = 2,
    print_fn: Callable[[str], None] = print,
) -> list[dict]:
    """Print the table (markdown) and return its rows as dicts, ratios where a peer ran; runs
    on ``threads`` threads and leaves the caller's count as it was."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if not batches or min(batches) < 1 or prompt_len < 1 or output_len < 2:
        raise ValueError("batches must be >= 1, prompt_len >= 1 and output_len >= 2")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_table(model, variants, batches, llama_cpp, prompt_len, output_len, threads, print_fn)
    finally:  # a caller's thread count is its own (a compiled step guards on it, for one)
        torch.set_num_threads(previous)


def _run_table(
    model: str | Path,
    variants: list[str],
    batches: list[int],
    llama_cpp: Path | None,
    prompt_len: int,
    output_len: int,
    threads: int,
    print_fn: Callable[[str], None],
) -> list[dict]:
    from deepinfer.weights.catalog import resolve_model

    checkpoint = resolve_model(str(model))
    print_fn(f"CPU: {cpu_description()}; threads {threads}; prompts {prompt_len}, outputs {output_len}")
    print_fn(
        "| variant | B | ours S_PP | ours S_TG | ours out tok/s | peer | peer S_TG | peer out tok/s "
        "| decode ratio | shape ratio |"
    )
    print_fn("|---|---|---|---|---|---|---|---|---|---|")
    table, fp32 = [], None
    for name in variants:
        options, peer = VARIANTS[name]
        llm = LLM(checkpoint, max_num_seqs=max(batches), enable_prefix_caching=False, **options)
        batched_bench(llm, 1, prompt_len, output_len)  # warm-up
        peer_run = (
            llama_cpp_rows(
                llama_cpp,
                checkpoint,
                peer,
                batches,
                prompt_len,
                output_len,
                threads,
                cache_type=PEER_CACHE_TYPES.get(name),
            )
            if llama_cpp is not None and peer is not None
            else PeerRows({}, None)
        )
        peer_label = (
            f"llama.cpp {peer}"
            + (f" KV {PEER_CACHE_TYPES[name]}" if name in PEER_CACHE_TYPES else "")
            + (f" ({peer_run.fallback}: its default crashed)" if peer_run.fallback else "")
        )
        for b in batches:
            ours = batched_bench(llm, b, prompt_len, output_len)
            row = {"variant": name, "batch": b, "ours": ours, "peer": peer_run.rows.get(b)}
            cells = [name, str(b), f"{ours[0]:.0f}", f"{ours[1]:.1f}", f"{ours[2]:.1f}"]
            if row["peer"] is not None:
                theirs = row["peer"]
                row["decode_ratio"], row["shape_ratio"] = ours[1] / theirs[1], ours[2] / theirs[2]
                cells += [peer_label, f"{theirs[1]:.1f}", f"{theirs[2]:.1f}"]
                cells += [f"{row['decode_ratio']:.2f}x", f"{row['shape_ratio']:.2f}x"]
            else:
                cells += ["-"] * 5
            table.append(row)
            print_fn("| " + " | ".join(cells) + " |")
        if name == "fp32":
            fp32 = llm
        elif fp32 is not None and llm.tokenizer is not None:
            same, err = agreement(fp32, llm)
            print_fn(
                f"  {name} vs fp32: greedy tokens before divergence {100 * same:.1f}%, "
                f"first-token top-5 |dlogprob| {err:.3f}"
            )
    return table


def default_llama_cpp() -> Path | None:
    """``$LLAMA_CPP_DIR`` when set (a built checkout), else None (no peer)."""
    value = os.environ.get("LLAMA_CPP_DIR")
    return Path(value) if value else None
