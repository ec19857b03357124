"""What each quantized mode costs in quality, ours beside llama.cpp's at the same bits, in one
run on one text (``benchmarks/quality.py``).

Both sides follow llama-perplexity's protocol (``quality/scoring.py``): ``ctx``-token chunks,
the second half of each scored. Each side's modes are compared with its own full-precision
run on the same tokens: perplexity and its change, the mean KL divergence from the
full-precision distributions and the share of tokens whose top-1 is unchanged (llama.cpp:
``--kl-divergence-base`` from its F32 file, then ``--kl-divergence``). Weights come from the
same checkpoint (llama.cpp's converter and ``llama-quantize`` make its files). Bits per weight,
scales included: ours over the quantized projections and head, llama.cpp's over its file's
matrices (projections and the token embedding its tied head reads).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from deepinfer.bench.llama_cpp import peer_gguf
from deepinfer.kernels.weight_only import WeightOnlyLinear
from deepinfer.llm import LLM
from deepinfer.models.layers.projection import projections
from deepinfer.quality import perplexity

# our mode -> (engine options, the llama.cpp mode beside it: (file type, K/V cache type))
MODES: dict[str, tuple[dict[str, Any], tuple[str, str | None] | None]] = {
    "fp32": ({}, ("F32", None)),
    "bf16": ({"quantization": "bf16"}, ("BF16", None)),  # bf16 weights, fp32 activations
    "bf16-activations": ({"dtype": "bfloat16"}, ("BF16", None)),  # activations rounded too
    "int8": ({"quantization": "int8"}, ("Q8_0", None)),
    "int4": ({"quantization": "int4"}, ("Q4_1", None)),  # 5 bits a weight, as ours
    "int4-vs-q4_0": ({"quantization": "int4"}, ("Q4_0", None)),
    "fp8-kv": ({"kv_cache_dtype": "fp8"}, ("F32", "q8_0")),
    "int8-kv": ({"kv_cache_dtype": "int8"}, ("F32", "q8_0")),
}


class Figures(NamedTuple):
    ppl: float
    kl: float | None
    top1: float | None  # share, 0..1
    bits: float | None  # bits per weight (None: not quantized / not reported)


def quantized_bits(llm: LLM) -> float | None:
    """Bits per weight of the engine's quantized projections, codes and scales (None when it
    quantizes none)."""
    stored = weights = 0
    engine_forms = (p.engine for p in projections(llm.engine.model))
    for proj in (f for f in engine_forms if isinstance(f, WeightOnlyLinear)):
        weights += proj.out_features * proj.in_features
        codes = {"int8": 8, "int4": 4, "bf16": 16}[proj.method]
        stored += (
            proj.out_features * proj.in_features * codes
            + proj.scales.numel() * 16  # fp16 scales (int8), fp16 scales and zeros (int4)
        )
    return stored / weights if weights else None


def ours(
    model: str | Path,
    modes: list[str],
    text: str,
    ctx: int,
    chunks: int,
    folder: Path,
    print_fn: Callable[[str], None] = print,
) -> dict[str, Figures]:
    """Our modes on ``text``; the first run (``fp32``) is the base the others are compared with."""
    base = folder / "ours-fp32.safetensors"
    out: dict[str, Figures] = {}
    for mode in ["fp32", *[m for m in modes if m != "fp32"]]:
        options = MODES[mode][0]
        key = tuple(sorted(options.items()))
        same = next((m for m in out if tuple(sorted(MODES[m][0].items())) == key), None)
        if same is not None:  # one engine setting beside two peers: measured once
            out[mode] = out[same]
            continue
        llm = LLM(model, compile=False, enable_prefix_caching=False, **options)
        report = perplexity(
            llm,
            text=text,
            ctx=ctx,
            chunks=chunks,
            save_logits=base if mode == "fp32" else None,
            kl_base=None if mode == "fp32" else base,
        )
        out[mode] = Figures(report.ppl, report.kl, report.top1, quantized_bits(llm))
        print_fn(f"ours {mode}: " + "; ".join(report.lines()[1:]))
        del llm
    return out


def gguf_bits(path: Path) -> float:
    """Bits per weight of a GGUF file's matrices (its 2-D tensors: projections and the token
    embedding, which a tied model's head reads), as stored."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")
_KLD = re.compile(r"Mean\s+KLD:\s+(-?[0-9.]+)")
_TOP = re.compile(r"Same top p:\s+([0-9.]+)")
_KL_PPL = re.compile(r"Mean\s+PPL\(Q\)\s+:\s+([0-9.]+)")


def parse_llama_perplexity(output: str) -> Figures:
    """llama-perplexity's figures from what it prints (with ``--kl-divergence``: its PPL(Q),
    mean KLD and same-top-p share; otherwise its final estimate)."""
    kl, top = _KLD.search(output), _TOP.search(output)
    ppl = _KL_PPL.search(output) or _PPL.search(output)
    if ppl is None:
        tail = "\n".join(output.strip().splitlines()[-5:])
        raise RuntimeError(f"llama-perplexity printed no perplexity:\n{tail}")
    return Figures(
        float(ppl.group(1)),
        float(kl.group(1)) if kl else None,
        float(top.group(1)) / 100 if top else None,
        None,  # bits: from the file itself (``gguf_bits``)
    )


def peer(
    root: Path,
    checkpoint: Path,
    modes: list[str],
    text_file: Path,
    ctx: int,
    chunks: int,
    threads: int,
    folder: Path,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    print_fn: Callable[[str], None] = print,
) -> dict[str, Figures]:
    """llama.cpp's modes beside ours: its F32 run writes the KL base, then each mode runs
    against it."""
    binary = root / "build" / "bin" / "llama-perplexity"
    if not binary.exists():
        raise FileNotFoundError(f"--llama-cpp: no {binary} (build llama.cpp's llama-perplexity there first)")
    base = folder / "peer-f32.kld"

    def perplexity_run(outtype: str, cache: str | None, extra: list[str]) -> str:
        gguf = peer_gguf(root, checkpoint, outtype, folder, run)
        args = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks)]
        args += ["-b", str(ctx), "-t", str(threads), *extra]
        if cache is not None:  # a quantized V cache needs flash attention
            args += ["-ctk", cache, "-ctv", cache, "-fa", "on"]
        done = run(args, check=True, capture_output=True, text=True)
        return done.stdout + done.stderr

    parse_llama_perplexity(perplexity_run("F32", None, ["--kl-divergence-base", str(base)]))
    out: dict[str, Figures] = {}
    for mode in modes:
        pair = MODES[mode][1]
        if pair is None:
            continue
        if pair in {MODES[m][1] for m in out}:
            out[mode] = out[next(m for m in out if MODES[m][1] == pair)]
            continue
        text = perplexity_run(*pair, ["--kl-divergence-base", str(base), "--kl-divergence"])
        figures = parse_llama_perplexity(text)
        if pair[0] not in ("F32", "BF16"):
            figures = figures._replace(bits=gguf_bits(peer_gguf(root, checkpoint, pair[0], folder, run)))
        out[mode] = figures
        print_fn(f"llama.cpp {pair[0]}{' + ' + pair[1] + ' KV' if pair[1] else ''}: {out[mode]}")
    return out


def _cell(figures: Figures | None, base: Figures | None) -> str:
    if figures is None:
        return "| | | | |"
    change = f"{100 * (figures.ppl / base.ppl - 1):+.3f}%" if base is not None else ""
    kl = "" if figures.kl is None else f"{figures.kl:.5f}"
    top = "" if figures.top1 is None else f"{100 * figures.top1:.2f}%"
    bits = "" if figures.bits is None else f"{figures.bits:.2f}"
    return f"| {figures.ppl:.4f} ({change}) | {kl} | {top} | {bits} |"


def table(modes: list[str], mine: dict[str, Figures], theirs: dict[str, Figures]) -> list[str]:
    """The markdown table: per mode, ours and llama.cpp's (PPL and its change from the same
    side's full precision, KL divergence, top-1 agreement, bits per weight)."""
    lines = [
        "| mode | PPL (change) | KL | top-1 | bits/weight | llama.cpp mode | PPL (change) | KL | top-1 | bits/weight |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        pair = MODES[mode][1]
        peer_name = "" if pair is None else pair[0] + (f" + {pair[1]} KV" if pair[1] else "")
        ref = theirs.get("fp32")
        ours_cell = _cell(mine.get(mode), mine.get("fp32"))
        peer_cell = _cell(theirs.get(mode), ref) if mode in theirs else "| | | | |"
        lines.append(f"| {mode} {ours_cell[:-1]}| {peer_name} {peer_cell}")
    return lines


def run_quality(
    model: str | Path,
    checkpoint: Path,
    text: str,
    modes: list[str],
    ctx: int = 512,
    chunks: int = 32,
    llama_cpp: Path | None = None,
    threads: int = 2,
    print_fn: Callable[[str], None] = print,
) -> list[str]:
    """Run both sides and print the table; returns its lines. ``checkpoint``: the
    transformers-format directory llama.cpp's converter reads (the same weights ``model``
    names)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"modes: unknown {unknown}; choose from {list(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        mine = ours(model, modes, text, ctx, chunks, folder, print_fn)
        theirs: dict[str, Figures] = {}
        if llama_cpp is not None:
            text_file = folder / "text.txt"
            text_file.write_text(text, encoding="utf-8")
            theirs = peer(
                llama_cpp, checkpoint, modes, text_file, ctx, chunks, threads, folder, print_fn=print_fn
            )
    lines = table(modes, mine, theirs)
    for line in lines:
        print_fn(line)
    return lines
