"""Decode step time of a V4-shaped model big enough to be bandwidth-bound on a GPU (a few GB
of bf16 weights, random, built by ``make_tiny_checkpoint`` with larger dims), in three engine
modes (eager, compiled, compiled + CUDA graphs), against the HBM-bandwidth bound and against
``transformers`` on the same weights. Run by ``benchmarks/gpu_check.sh``.

``--small`` uses the tiny dims so the script's logic can be checked on a CPU in seconds.
Prints a markdown table for ``benchmarks/RESULTS.md``, one row as soon as it is measured; a
mode or the peer that fails prints its error in its row and the rest still run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

# ~1.9B parameters (3.8 GB in bf16): 8 layers, 32 experts of 2048 x 1024, top-6
BIG = {
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
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def hbm_bound(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def bytes_per_step(model, batch: int) -> int:
    """Weight bytes one decode step must read: everything but the routed experts, plus the
    experts the batch can touch (top-k per token, at most all of them)."""
    cfg = model.config
    expert_bytes = routed_bytes = 0
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if ".experts." in name:
            routed_bytes += size
    if cfg.n_routed_experts:
        expert_bytes = routed_bytes * min(1.0, batch * cfg.num_experts_per_tok / cfg.n_routed_experts)
    return int(total - routed_bytes + expert_bytes)


def engine_step_times(
    path: Path, device: str, batches: list[int], mode: str, steps: int
) -> tuple[dict[int, float], object]:
    """Mean seconds per pure-decode engine step (all ``batch`` requests decoding) for each
    batch size, from one engine (one compile, one set of captured graphs) per mode."""
    llm = LLM(
        path,
        dtype="bfloat16" if device != "cpu" else "float32",
        device=device,
        compile=mode != "eager",
        capture_graphs=mode == "graphs",
        max_num_seqs=max(batches),
        max_model_len=512,
        async_scheduling=False,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    times: dict[int, float] = {}
    for batch in batches:
        ids = [f"{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [3 + (i * 7 + j) % 200 for j in range(16)], params)
        while any(engine.requests[r].num_computed_tokens < 16 for r in ids):
            engine.step()  # prefill
        for _ in range(4):
            engine.step()  # warm-up (compile on the first engine step of a new shape)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        times[batch] = (time.perf_counter() - start) / steps
        for rid in ids:
            engine.abort(rid)
            engine.pop_finished(rid)
    model = engine.model
    engine.shutdown()
    return times, model


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def transformers_step_times(path: Path, device: str, batches: list[int], steps: int) -> dict[int, float]:
    """Per-token time of ``transformers.generate`` (difference of two lengths: no prefill)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    times = {}
    for batch in batches:
        ids = torch.randint(3, 200, (batch, 16), device=device)
        times[batch] = _generate_time_per_token(model, ids, device, steps)
    return times


def _generate_time_per_token(model, ids: torch.Tensor, device: str, steps: int) -> float:
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        return time.perf_counter() - start

    run(4)
    return (run(steps + 1) - run(1)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--small", action="store_true", help="tiny dims (a CPU check of this script)")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled", "graphs"])
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    args = parser.parse_args()
    device = torch.device(args.device)
    overrides = {} if args.small else BIG
    start = time.perf_counter()
    path = make_tiny_checkpoint(
        Path(tempfile.mkdtemp()) / "v4-bench", arch="deepseek_v4", dtype=torch.bfloat16, **overrides
    )
    print(f"checkpoint written in {time.perf_counter() - start:.1f} s", flush=True)
    modes = [m for m in args.modes if m != "graphs" or device.type == "cuda"]
    bound = hbm_bound(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, modes {modes}", flush=True)
    print("| batch | mode | step (ms) | tok/s | % of HBM bound | build + run (s) |")
    print("|---:|---|---:|---:|---:|---:|", flush=True)
    # our engine first: a failing peer must not cost our rows; each mode fails alone
    for mode in modes:
        start = time.perf_counter()
        try:
            times, model = engine_step_times(path, args.device, args.batches, mode, args.steps)
        except Exception as e:  # report and go on to the next mode
            print(f"| - | {mode} | failed: {type(e).__name__}: {str(e)[:300]} | | | |", flush=True)
            continue
        wall = time.perf_counter() - start
        for batch, step in times.items():
            floor = bytes_per_step(model, batch) / bound if bound else None
            pct = f"{100 * floor / step:.0f}%" if floor else "n/a"
            print(
                f"| {batch} | {mode} | {step * 1e3:.2f} | {batch / step:.0f} | {pct} | {wall:.0f} |",
                flush=True,
            )
        del model
    if args.no_peer:
        return
    start = time.perf_counter()
    try:
        peer = transformers_step_times(path, args.device, args.batches, args.steps)
    except Exception as e:  # transformers may not know this checkpoint format
        print(f"| - | transformers | failed: {type(e).__name__}: {str(e)[:300]} | | | |", flush=True)
        return
    wall = time.perf_counter() - start
    for batch, step in peer.items():
        print(
            f"| {batch} | transformers | {step * 1e3:.2f} | {batch / step:.0f} | | {wall:.0f} |", flush=True
        )


if __name__ == "__main__":
    main()
