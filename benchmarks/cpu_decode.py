"""SmolLM2-135M on the CPU in llama.cpp's ``llama-batched-bench`` shape, against llama.cpp in
the same run when its binary is given (issue 16).

B sequences of 144-token prompts, 64 output tokens each; reported per B: prefill tok/s
(``S_PP``), decode tok/s (``S_TG``) and the whole shape's output tok/s (B x 64 / wall).
Variants: our fp32 (exact), bf16, weight-only int8 and int4 (``quantization=``) against
llama.cpp F32, Q8_0 and Q4_0 converted from the same checkpoint. Also prints the CPU's ISA
(so figures from different machines are never compared as if alike) and, for the quantized
variants, greedy agreement and first-token logprob error against our fp32 on chat prompts.

Run: ``python benchmarks/cpu_decode.py [--llama-cpp DIR] [--batches 1 8 16 32]`` where DIR is a
llama.cpp checkout built with ``llama-batched-bench`` and ``llama-quantize``
(``../shared/reference/cpu_peers.md``); its converter needs ``pip install gguf sentencepiece``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench_serve import CHAT_PROMPTS
from deepinfer.weights.catalog import resolve_model

PROMPT_LEN, OUTPUT_LEN = 144, 64
CHAT = CHAT_PROMPTS[:8]  # the agreement report's chat prompts
# llama-batched-bench keeps its KV cache in f16 unless told otherwise: "fp32-kv16" is our fp32
# weights with an fp16 KV cache, the same precision on both sides; "fp32" is our exact default.
VARIANTS = {
    "fp32": ({}, "F32"),
    "fp32-kv16": ({"kv_cache_dtype": "float16"}, "F32"),
    "bf16": ({"dtype": "bfloat16"}, None),
    "int8": ({"quantization": "int8"}, "Q8_0"),
    "int4": ({"quantization": "int4"}, "Q4_0"),
}


def isa() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "?",
    )
    have = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags
    ]
    return f"{model}; {' '.join(have)}; torch capability {torch.backends.cpu.get_cpu_capability()}"


def batched_bench(llm: LLM, batch: int) -> tuple[float, float, float]:
    """(prefill tok/s, decode tok/s, output tok/s of the whole shape) for B sequences."""
    engine = llm.engine
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(PROMPT_LEN)] for i in range(batch)]
    reqs = [
        engine.add_request(f"b{batch}-{time.perf_counter_ns()}-{i}", p, params) for i, p in enumerate(prompts)
    ]
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
        batch * PROMPT_LEN / (prefilled - start),
        batch * (OUTPUT_LEN - 1) / (end - prefilled),
        batch * OUTPUT_LEN / (end - start),
    )


def agreement(reference: LLM, other: LLM, tokenizer) -> tuple[float, float]:
    """(share of greedy tokens equal to fp32's before the first divergence, over all 32 x
    prompts; mean |logprob difference| of the first token's top-5 under fp32)."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in CHAT
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    ref = reference.generate(prompts, params, use_tqdm=False)
    got = other.generate(prompts, params, use_tqdm=False)
    same, errors = 0, []
    for a, b in zip(ref, got, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        errors += [abs(first_a[t].logprob - first_b[t].logprob) for t in first_a if t in first_b]
    return same / (32 * len(prompts)), sum(errors) / max(len(errors), 1)


def llama_cpp_rows(
    root: Path, checkpoint: Path, outtype: str, batches: list[int]
) -> dict[int, tuple[float, float, float]]:
    """llama-batched-bench on the same weights converted to ``outtype`` (F32, Q8_0, Q4_0)."""
    bench = root / "build" / "bin" / "llama-batched-bench"
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / f"smol-{outtype.lower()}.gguf"
        base = Path(tmp) / "smol-f32.gguf"
        convert = [sys.executable, str(root / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile"]
        if outtype in ("F32", "Q8_0"):
            subprocess.run(
                [*convert, str(gguf), "--outtype", outtype.lower()], check=True, capture_output=True
            )
        else:
            subprocess.run([*convert, str(base), "--outtype", "f32"], check=True, capture_output=True)
            quantize = root / "build" / "bin" / "llama-quantize"
            subprocess.run([str(quantize), str(base), str(gguf), outtype], check=True, capture_output=True)
        args = [
            str(bench),
            "-m",
            str(gguf),
            "-c",
            "12288",
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(PROMPT_LEN),
        ]
        args += ["-ntg", str(OUTPUT_LEN), "-npl", ",".join(map(str, batches)), "-t", "2", "-tb", "2"]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[2] or ""):
            b = int(cells[2])
            s_pp, s_tg, total = float(cells[5]), float(cells[7]), float(cells[8])
            rows[b] = (s_pp, s_tg, b * OUTPUT_LEN / total)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp checkout")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    checkpoint = resolve_model("smollm2-135m")
    print(f"CPU: {isa()}; threads 2")
    print(
        "| variant | B | ours S_PP | ours S_TG | ours out tok/s | peer | peer S_TG | peer out tok/s | decode ratio | shape ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    fp32 = None
    for name in args.variants:
        kwargs, peer = VARIANTS[name]
        # no prefix cache: each B reuses the previous B's prompts (and B=1 the warm-up's), which
        # llama-batched-bench computes again; a cache hit would be a prefill the peer pays for
        llm = LLM(checkpoint, max_num_seqs=max(args.batches), enable_prefix_caching=False, **kwargs)
        batched_bench(llm, 1)  # warm-up
        peer_rows = (
            llama_cpp_rows(args.llama_cpp, checkpoint, peer, args.batches) if args.llama_cpp and peer else {}
        )
        for b in args.batches:
            pp, tg, out = batched_bench(llm, b)
            p = peer_rows.get(b)
            cells = [name, str(b), f"{pp:.0f}", f"{tg:.1f}", f"{out:.1f}"]
            if p is not None:
                cells += [
                    f"llama.cpp {peer}",
                    f"{p[1]:.1f}",
                    f"{p[2]:.1f}",
                    f"{tg / p[1]:.2f}x",
                    f"{out / p[2]:.2f}x",
                ]
            else:
                cells += ["-", "-", "-", "-", "-"]
            print("| " + " | ".join(cells) + " |", flush=True)
        if name == "fp32":
            fp32 = llm
        elif fp32 is not None and llm.tokenizer is not None:
            same, err = agreement(fp32, llm, llm.tokenizer)
            print(
                f"  {name} vs fp32: greedy tokens before divergence {100 * same:.1f}%, first-token top-5 |dlogprob| {err:.3f}"
            )


if __name__ == "__main__":
    main()
