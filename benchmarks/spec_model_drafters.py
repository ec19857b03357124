"""What the model drafters (DSpark on V4.1, MTP on V4) cost and what they can give, on the
tiny random checkpoints (no trained draft weights exist offline, so their own drafts are
almost never accepted; that run measures pure overhead).

For each model, greedy decoding of the same prompts three ways, outputs checked identical:
- plain: no speculation;
- drafter: the model drafter as is (random weights: the overhead of drafting + verifying);
- oracle: the drafter runs its full computation, then its tokens are replaced by the
  target's own continuation (known from the plain run), so every draft is accepted: the
  ceiling of the verify path with this drafter's cost included.

Reports output tokens/s, the share of wall time spent in the drafter, and tokens per
verified chunk. Run: ``python benchmarks/spec_model_drafters.py [--k 4] [--concurrency 1 8]``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint


class Timed:
    """Wraps a drafter's observe/propose and sums their wall time."""

    def __init__(self, drafter, oracle: dict[str, list[int]] | None) -> None:
        self.drafter, self.oracle, self.seconds = drafter, oracle, 0.0
        self._observe, self._propose = drafter.observe, drafter.propose
        drafter.observe, drafter.propose = self.observe, self.propose

    def observe(self, *args):
        start = time.perf_counter()
        self._observe(*args)
        self.seconds += time.perf_counter() - start

    def propose(self, asks):
        start = time.perf_counter()
        drafts = self._propose(asks)
        self.seconds += time.perf_counter() - start
        if self.oracle is not None:
            for ask, draft in zip(asks, drafts, strict=True):
                seq = self.oracle[self.drafter.ring.owner[ask.slot]]
                k = len(draft.tokens) or self.drafter.num_draft_tokens
                draft.tokens = seq[ask.anchor_pos + 1 : ask.anchor_pos + 1 + k]
                draft.q = None
        return drafts


def run(llm: LLM, prompts, params, concurrency: int) -> tuple[float, list[list[int]], float]:
    outs, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = llm.generate(prompts[i : i + concurrency], params, use_tqdm=False)
        outs += [o.outputs[0].token_ids for o in batch]
        tokens += sum(len(o.outputs[0].token_ids) for o in batch)
    wall = time.perf_counter() - start
    return tokens / wall, outs, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(8, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(
        "| model | drafter | concurrency | plain tok/s | drafter tok/s (acc.) | oracle tok/s | drafter share of wall | tokens / verify (oracle) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch, method in (("deepseek_v41", "dspark"), ("deepseek_v4", "mtp")):
            path = make_tiny_checkpoint(Path(tmp) / arch, arch=arch)
            for conc in args.concurrency:
                plain_llm = LLM(path, max_num_seqs=conc)
                run(plain_llm, prompts[:conc], params, conc)  # warm-up
                plain_rate, plain, _ = run(plain_llm, prompts, params, conc)
                row = [arch, f"{method} k={args.k}", str(conc), f"{plain_rate:.1f}"]
                for oracle in (False, True):
                    llm = LLM(
                        path,
                        max_num_seqs=conc,
                        speculative_config={"method": method, "num_speculative_tokens": args.k},
                    )
                    timed = Timed(
                        llm.engine.spec.drafter, _OwnerKeyed(llm, prompts, plain) if oracle else None
                    )
                    rate, outs, wall = run(llm, prompts, params, conc)
                    assert outs == plain, "speculation changed greedy outputs"
                    stats = llm.engine.spec.stats
                    if oracle:
                        row += [
                            f"{rate:.1f}",
                            f"{100 * timed.seconds / wall:.0f}%",
                            f"{stats.mean_acceptance_length:.2f}",
                        ]
                    else:
                        row.append(f"{rate:.1f} ({100 * stats.accepted / max(stats.drafted, 1):.0f}%)")
                print("| " + " | ".join(row) + " |")


class _OwnerKeyed(dict):
    """Request id -> the plain run's full sequence, looked up by prompt (ids are per call)."""

    def __init__(self, llm: LLM, prompts, plain) -> None:
        super().__init__()
        self.llm = llm
        self.by_prompt = {tuple(p): p + o for p, o in zip(prompts, plain, strict=True)}

    def __getitem__(self, request_id: str) -> list[int]:
        req = self.llm.engine.requests[request_id]
        return self.by_prompt[tuple(req.prompt_token_ids)]


if __name__ == "__main__":
    main()
