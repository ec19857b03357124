"""Multi-LoRA throughput on SmolLM2-135M (CPU): a batch mixing eight adapters beside the base
model's throughput, in one run, on the same requests.

- ``base``: ``LLM(path)`` running every request on the base model (its fastest form: the
  one-call decode stack);
- ``mixed``: ``LLM(path, enable_lora=True, max_loras=8)`` with the requests spread over eight
  PEFT adapters (rank ``--rank`` on ``--targets``), every step mixing them;
- ``mixed, layer loop``: the same mixed batch with the one-call CPU decode stack switched off
  (steps holding adapter rows run the model's layer loop): the feature's eager form;
- ``one adapter at a time``: the same engine given each adapter's requests as a batch of
  their own, one after another (what serving without grouped LoRA steps does);
- peer: transformers + PEFT, the same mixed batch through ``generate(adapter_names=...)``
  (PEFT's mixed-adapter inference), prompts of equal length, greedy.

The bytes bound of the mixed batch is the base model's throughput scaled by the bytes a
decode step reads: base weights / (base weights + every adapter's A and B), each adapter's
matrices read once a step.

Every request has the same prompt length and generates ``--tokens`` tokens (``ignore_eos``),
so every form computes the same tokens. Throughput is generated tokens per second; each form
is the best of ``--repeats`` rounds that alternate the forms, after a warm-up round.

    python benchmarks/lora_throughput.py [--requests 32] [--tokens 64] [--rank 16]
        [--targets all|qv] [--peer/--no-peer]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.engine import setup as engine_setup
from deepinfer.weights.catalog import resolve_model

MODEL = "smollm2-135m"
TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}
ADAPTERS = 8


def make_adapters(path: Path, out: Path, rank: int, targets: list[str]) -> tuple[object, list[Path]]:
    """Eight PEFT adapters saved under ``out`` (random A and B); returns the PEFT model
    holding all of them (for the peer) and their directories."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    dirs, peft_model = [], None
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        single = get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():
            for name, param in single.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.1)
        dirs.append(out / f"adapter{i}")
        single.save_pretrained(str(dirs[-1]))
        if peft_model is None:
            from peft import PeftModel

            peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs[-1]), adapter_name="a0")
        else:
            peft_model.load_adapter(str(dirs[-1]), adapter_name=f"a{i}")
    return peft_model, dirs


def best_of(fn: Callable[[], int], repeats: int) -> float:
    """Generated tokens per second of ``fn`` (which returns its token count), best run."""
    return alternated({"fn": fn}, repeats)["fn"]


def alternated(forms: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Each form's generated tokens per second (each returns its token count), the best of
    ``repeats`` rounds that run every form in turn (after one warm-up round), so a slow
    stretch of the machine falls on all of them alike."""
    best = dict.fromkeys(forms, 0.0)
    for round_ in range(repeats + 1):
        for name, fn in forms.items():
            start = time.perf_counter()
            tokens = fn()
            if round_:
                best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    path = resolve_model(MODEL)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1000, 40000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    total = args.requests * args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, dirs = make_adapters(path, Path(tmp), args.rank, TARGETS[args.targets])
        requests = [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        spread = [requests[i % ADAPTERS] for i in range(args.requests)]

        base = LLM(path, max_num_seqs=args.requests)
        options = dict(
            enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank, max_num_seqs=args.requests
        )
        lora = LLM(path, **options)
        with mock.patch.object(engine_setup, "one_call_decode", lambda model: None):
            layer_loop = LLM(path, **options)

        def one_at_a_time() -> int:
            for r in requests:
                mine = [p for p, s in zip(prompts, spread, strict=True) if s is r]
                lora.generate(mine, params, use_tqdm=False, lora_request=r)
            return total

        forms: dict[str, Callable[[], int]] = {
            "base": lambda: len(base.generate(prompts, params, use_tqdm=False)) * args.tokens,
            "mixed": lambda: (
                len(lora.generate(prompts, params, use_tqdm=False, lora_request=spread)) * args.tokens
            ),
            "mixed, layer loop": lambda: (
                len(layer_loop.generate(prompts, params, use_tqdm=False, lora_request=spread)) * args.tokens
            ),
            "one adapter at a time": one_at_a_time,
        }
        rates = alternated(forms, args.repeats)
        if args.peer:
            names = [f"a{i % ADAPTERS}" for i in range(args.requests)]
            ids = torch.tensor(prompts)

            def peer() -> int:
                with torch.no_grad():
                    peft_model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        adapter_names=names,
                        do_sample=False,
                        max_new_tokens=args.tokens,
                        min_new_tokens=args.tokens,
                    )
                return total

            rates["transformers + PEFT (mixed)"] = best_of(peer, 1)
    print(
        f"SmolLM2-135M, {args.requests} requests x {args.prompt_len} prompt + {args.tokens} generated tokens,"
    )
    print(
        f"{ADAPTERS} adapters of rank {args.rank} on {args.targets} linears; torch threads {torch.get_num_threads()}"
    )
    for name, rate in rates.items():
        print(f"  {name:32s} {rate:8.1f} tok/s   {rate / rates['base']:.3f}x base")
    base_bytes = sum(p.numel() * p.element_size() for p in base.engine.model.parameters())
    adapter_bytes = sum(
        (u.a.numel() + u.b.numel()) * u.a.element_size()
        for loaded in lora.engine.lora.adapters.values()
        for u in loaded.adapter.updates.values()
    )
    bound = rates["base"] * base_bytes / (base_bytes + adapter_bytes)
    print(
        f"  bytes bound of the mixed batch   {bound:8.1f} tok/s   {bound / rates['base']:.3f}x base "
        f"(base {base_bytes / 1e6:.1f} MB + adapters {adapter_bytes / 1e6:.1f} MB a step); "
        f"mixed reaches {rates['mixed'] / bound:.3f} of it"
    )


if __name__ == "__main__":
    main()
