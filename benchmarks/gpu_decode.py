"""Decode step time of models big enough to be bandwidth-bound on a GPU (random bf16 weights
built by ``make_tiny_checkpoint`` with real dims: a SmolLM2-1.7B-shaped Llama and a 1.9B
V4), per engine mode, against the HBM-bandwidth bound and against ``transformers`` on the
same weights. Run by ``benchmarks/gpu_check.sh``, one invocation per stage.

Modes: ``graphs-eager`` (CUDA graphs captured from the eager step), ``eager``, ``compiled``
(Inductor), ``graphs`` (CUDA graphs captured from the Inductor step) and ``transformers``
(``generate`` on the same checkpoint). Rows come in the order model, batch, mode, so the
first rows of a run are its key figures; each is printed and appended to ``--results`` (and
flushed) as soon as it is measured, so a run its time limit kills keeps every row measured
before. A mode that fails puts its error in its rows and the others still run.

Each row has the step's device time (CUDA events recorded before and after each engine step,
on the stream the step and its graph replays run on: this includes the gaps while the host
launches kernels, so device close to host means a host-bound step) beside its host wall time,
and the percent of the HBM bound (weight bytes a step reads over the bandwidth) that the
device time reaches.

``--small`` uses the tiny dims so the script's logic can be checked on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

# SmolLM2-1.7B's shapes (its config.json): 1.7B parameters, 3.4 GB in bf16, tied head
SMOLLM2_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 64,
    "vocab_size": 49152,
    "rope_theta": 130000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
# ~1.9B parameters (3.8 GB in bf16): 8 layers, 32 experts of 2048 x 1024, top-6
V4_1_9B = {
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "head_dim": 256,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 512,
    "o_groups": 4,
    "o_lora_rank": 512,
    "n_routed_experts": 32,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0, 4, 128, 0, 0],
    "index_topk": 64,
    "index_n_heads": 16,
    "index_head_dim": 64,
}
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {  # name: (row label, arch, dims)
    "smollm2": ("smollm2-1.7b", "llama", SMOLLM2_1_7B),
    "v4": ("v4-1.9b", "deepseek_v4", V4_1_9B),
}
# engine options per mode (``transformers`` is the peer, not an engine mode)
ENGINE_MODES: dict[str, dict[str, bool]] = {
    "graphs-eager": {"compile": False, "capture_graphs": True},
    "eager": {"compile": False, "capture_graphs": False},
    "compiled": {"compile": True, "capture_graphs": False},
    "graphs": {"compile": True, "capture_graphs": True},
}
MODES = [*ENGINE_MODES, "transformers"]
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
HEADER = (
    "| model | batch | mode | device ms/step | host ms/step | tok/s | % of HBM bound | note |\n"
    "|---|---:|---|---:|---:|---:|---:|---|"
)
PROMPT_LEN = 16
WARMUP_STEPS = 4
HANG_ENV = "GPU_DECODE_HANG_AFTER_ROWS"  # the script's own test: stop responding after N rows


def hbm_bound(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def bytes_per_step(model: torch.nn.Module, batch: int) -> int:
    """Weight bytes one decode step must read: everything but the routed experts, plus the
    experts the batch can touch (top-k per token, at most all of them)."""
    cfg = model.config
    routed_bytes = total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if ".experts." in name:
            routed_bytes += size
    experts = getattr(cfg, "n_routed_experts", None)
    if not experts:
        return total
    touched = min(1.0, batch * cfg.num_experts_per_tok / experts)
    return int(total - routed_bytes + routed_bytes * touched)


class Rows:
    """Prints each row and appends it to the results file at once (flushed to disk)."""

    def __init__(self, results: Path | None) -> None:
        self.results = results
        self.count = 0
        hang = os.environ.get(HANG_ENV)
        self.hang_after = int(hang) if hang else None
        self.emit(HEADER, count=False)

    def emit(self, line: str, count: bool = True) -> None:
        print(line, flush=True)
        if self.results is not None:
            with open(self.results, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        if not count:
            return
        self.count += 1
        if self.hang_after is not None and self.count >= self.hang_after:
            print(f"{HANG_ENV}={self.hang_after}: waiting to be stopped", flush=True)
            while True:
                time.sleep(60)

    def row(
        self,
        model: str,
        batch: int,
        mode: str,
        device_s: float | None = None,
        host_s: float | None = None,
        pct: float | None = None,
        note: str = "",
    ) -> None:
        def ms(s: float | None) -> str:
            return f"{s * 1e3:.2f}" if s is not None else "n/a"

        tok = f"{batch / host_s:.0f}" if host_s else "n/a"
        share = f"{pct:.1f}%" if pct is not None else "n/a"
        note = note.replace("|", "/").replace("\n", " ")
        self.emit(
            f"| {model} | {batch} | {mode} | {ms(device_s)} | {ms(host_s)} | {tok} | {share} | {note} |"
        )


def checkpoint(root: Path, name: str, small: bool) -> Path:
    """The model's random checkpoint under ``root``, written once and shared by the script's
    stages (written beside, then renamed: a stage killed while writing leaves no half)."""
    label, arch, dims = MODELS[name]
    path = root / f"{label}{'-small' if small else ''}"
    if (path / "config.json").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(tmp, arch=arch, dtype=torch.bfloat16, **({} if small else dims))
    tmp.rename(path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], Any], n: int, device: torch.device) -> tuple[float | None, float]:
    """Mean device seconds (CUDA events around each call; None off CUDA) and mean host wall
    seconds of ``n`` calls of ``step``."""
    pairs = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            pairs.append((begin, end))
        else:
            step()
    _sync(device)
    host = (time.perf_counter() - start) / n
    device_s = sum(b.elapsed_time(e) for b, e in pairs) / 1e3 / n if pairs else None
    return device_s, host


class EngineBench:
    """One engine (one compile, one set of captured graphs) measured at each batch size."""

    def __init__(self, path: Path, device: torch.device, mode: str, max_batch: int, backend: str) -> None:
        start = time.perf_counter()
        self.llm = LLM(
            path,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            device=str(device),
            max_num_seqs=max_batch,
            max_model_len=512,
            kv_cache_memory_bytes=(8 << 30) if device.type == "cuda" else (256 << 20),
            async_scheduling=False,
            compile_backend=backend,
            **ENGINE_MODES[mode],
        )
        self.device = device
        self.model = self.llm.engine.model
        self.build_s = time.perf_counter() - start

    def measure(self, batch: int, steps: int) -> tuple[float | None, float, str]:
        """Pure-decode steps with ``batch`` requests decoding: (device s, host s, note)."""
        engine = self.llm.engine
        params = SamplingParams(max_tokens=WARMUP_STEPS + steps + 8, temperature=0.0, ignore_eos=True)
        ids = [f"{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [3 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)], params)
        while any(engine.requests[r].num_computed_tokens < PROMPT_LEN for r in ids):
            engine.step()  # prefill
        for _ in range(WARMUP_STEPS):
            engine.step()  # warm-up (a compiled step compiles at its first step of a new shape)
        graphs = getattr(engine.runner, "graphs", None)
        replays = graphs.replays if graphs is not None else 0
        device_s, host_s = timed_steps(engine.step, steps, self.device)
        for rid in ids:
            engine.abort(rid)
            engine.pop_finished(rid)
        note = f"built in {self.build_s:.0f} s"
        if graphs is not None:
            note += f"; {graphs.replays - replays}/{steps} steps replayed"
        return device_s, host_s, note

    def close(self) -> None:
        self.llm.engine.shutdown()


class PeerBench:
    """``transformers.generate`` on the same checkpoint: per-token time as the difference of
    two generation lengths (no prefill in it)."""

    def __init__(self, path: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = device
        self.build_s = time.perf_counter() - start

    def measure(self, batch: int, steps: int) -> tuple[float | None, float, str]:
        ids = torch.randint(3, 200, (batch, PROMPT_LEN), device=self.device)
        mask = torch.ones_like(ids)

        def generate(n: int) -> Callable[[], Any]:
            return lambda: self.model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )

        generate(WARMUP_STEPS)()
        long_dev, long_host = timed_steps(generate(steps + 1), 1, self.device)
        short_dev, short_host = timed_steps(generate(1), 1, self.device)
        device_s = (long_dev - short_dev) / steps if long_dev is not None and short_dev is not None else None
        return device_s, (long_host - short_host) / steps, f"loaded in {self.build_s:.0f} s"

    def close(self) -> None:
        del self.model


def run(args: argparse.Namespace, rows: Rows) -> None:
    device = torch.device(args.device)
    bound = hbm_bound(device)
    root = Path(args.checkpoints or tempfile.mkdtemp(prefix="gpu-decode-"))
    root.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        label = MODELS[name][0]
        start = time.perf_counter()
        try:
            path = checkpoint(root, name, args.small)
        except Exception as e:  # the next model may still work
            for batch in args.batches:
                for mode in args.modes:
                    rows.row(label, batch, mode, note=f"no checkpoint: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"{label}: checkpoint ready in {time.perf_counter() - start:.1f} s", flush=True)
        benches: dict[str, EngineBench | PeerBench] = {}
        failed: dict[str, str] = {}
        for batch in args.batches:
            for mode in args.modes:
                if ENGINE_MODES.get(mode, {}).get("capture_graphs") and device.type != "cuda":
                    rows.row(label, batch, mode, note="skipped: CUDA graphs need a CUDA device")
                    continue
                if mode in failed:
                    rows.row(label, batch, mode, note=failed[mode])
                    continue
                try:
                    if mode == "transformers" and mode not in benches:
                        benches[mode] = PeerBench(path, device)
                    elif mode not in benches:
                        benches[mode] = EngineBench(
                            path, device, mode, max(args.batches), args.compile_backend
                        )
                    bench = benches[mode]
                    device_s, host_s, note = bench.measure(batch, args.steps)
                except Exception as e:  # report it in this mode's rows, go on with the others
                    failed[mode] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                    rows.row(label, batch, mode, note=failed[mode])
                    continue
                step = device_s if device_s is not None else host_s
                pct = 100 * bytes_per_step(bench.model, batch) / bound / step if bound else None
                rows.row(label, batch, mode, device_s, host_s, pct, note)
        for bench in benches.values():
            bench.close()
        benches.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["graphs-eager", "eager"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--small", action="store_true", help="tiny dims (a CPU check of this script)")
    parser.add_argument("--results", type=Path, help="markdown file the rows are appended to")
    parser.add_argument("--checkpoints", help="folder of the random checkpoints, kept across runs")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of compiled modes"
    )
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    print(f"device: {name}, torch {torch.__version__}, modes {args.modes}", flush=True)
    run(args, Rows(args.results))


if __name__ == "__main__":
    main()
