"""All-to-all volume of expert parallel under data-parallel attention: the analytic model
for V4.1-Flash, and the model checked against the bytes the CPU ranks count.

    python benchmarks/ep_all_to_all.py [--requests 24] [--ranks 2 4]

The model (``distributed/expert_parallel.py``): a token is sent once to each other rank
holding one of its k distinct experts and one weighted sum comes back from each; under
uniform routing a given other rank is missed with probability C(E - E/N, k) / C(E, k).
The check runs tiny V4 checkpoints with ``data_parallel_size=N, enable_expert_parallel=True``
on a random workload and reads rank 0's per-layer counters (``AllToAllDispatch``).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.expert_parallel import AllToAllDispatch, expected_remote_ranks
from deepinfer.models.released_configs import V41_FLASH
from deepinfer.tiny import make_tiny_checkpoint


def analytic_table() -> str:
    text = V41_FLASH["text_config"]
    hidden, experts, k = text["hidden_size"], text["n_routed_experts"], text["num_experts_per_tok"]
    layers = text["num_hidden_layers"]
    bf16 = hidden * 2
    fp8 = hidden + hidden // 128 * 4  # e4m3 values and one fp32 scale per 128
    lines = [
        f"V4.1-Flash: hidden {hidden}, E = {experts}, k = {k}, {layers} MoE layers; per rank and "
        "decode step, bytes sent (dispatch out + combine back; about as much is received)",
        "",
        "| EP | remote ranks per token | tokens per rank | bf16 both ways (this code) | fp8 out, bf16 back (DeepEP) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for ranks in (8, 64):
        remote = expected_remote_ranks(ranks, k, experts)
        for tokens in (1, 8, 64, 256):
            ours = tokens * layers * remote * (bf16 + bf16)
            deepep = tokens * layers * remote * (fp8 + bf16)
            lines.append(
                f"| {ranks} | {remote:.2f} | {tokens} | {ours / 1e6:.2f} MB | {deepep / 1e6:.2f} MB |"
            )
    return "\n".join(lines)


def measured(ranks: int, requests: int, seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "v4", arch="deepseek_v4", seed=seed)
        rng = random.Random(seed)
        prompts = [[rng.randrange(2, 258) for _ in range(rng.randrange(8, 96))] for _ in range(requests)]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        llm = LLM(
            str(path), data_parallel_size=ranks, enable_expert_parallel=True, max_num_batched_tokens=256
        )
        try:
            llm.generate(prompts, params, use_tqdm=False)
            dispatchers = [
                m.dispatch
                for m in llm.model.modules()
                if isinstance(getattr(m, "dispatch", None), AllToAllDispatch)
            ]
            cfg = llm.model.config
        finally:
            llm.close()
    tokens = sum(d.tokens for d in dispatchers)
    rows = sum(d.dispatch_rows for d in dispatchers)
    back = sum(d.combine_rows for d in dispatchers)
    payload = sum(d.payload_bytes for d in dispatchers)
    row_bytes = cfg.hidden_size * 4  # float32 on the CPU
    return {
        "ranks": ranks,
        "experts": cfg.n_routed_experts,
        "k": cfg.num_experts_per_tok,
        "token_layers": tokens,
        "rows_out": rows,
        "rows_back": back,
        "payload_bytes": payload,
        "payload_check": payload == (rows + back) * row_bytes,
        "rows_per_token": rows / tokens,
        "uniform_model": expected_remote_ranks(ranks, cfg.num_experts_per_tok, cfg.n_routed_experts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    print(analytic_table())
    print()
    print(
        "| ranks | E | k | token-layers (rank 0) | rows out | rows back | counted payload = rows x row bytes | rows per token | uniform model |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for ranks in args.ranks:
        m = measured(ranks, args.requests)
        print(
            f"| {m['ranks']} | {m['experts']} | {m['k']} | {m['token_layers']} | {m['rows_out']} | "
            f"{m['rows_back']} | {m['payload_check']} ({m['payload_bytes']} B) | {m['rows_per_token']:.3f} | "
            f"{m['uniform_model']:.3f} |"
        )


if __name__ == "__main__":
    main()
