"""GRPO on SmolLM2-135M with a verifiable reward, generating every rollout from the module
being trained.

The task is generated here: few-shot sums of two small numbers (``"6+8="``), rewarded 1 when
the completion is the right number followed by a newline. Every ``--eval-every`` steps, greedy accuracy on a fixed held-out set of sums is
measured (the clean signal; the per-step reward is a small, noisy sample). Each step:

1. rollout: ``LLM.from_model(model)`` samples a group of completions per prompt from the
   current weights (no copy, no reload: the engine computes with the module's parameters);
2. train: group-normalized advantages (GRPO; Shao et al., 2024, "DeepSeekMath") and the clipped
   policy-gradient loss over the completion tokens, against the rollout's own logprobs; one
   AdamW step;
3. sync: ``llm.sync_weights()`` remakes the engine's derived copies of what the step wrote.

With ``--batch-invariant`` (the default) the rollout's logprobs are the training forward's bit
for bit, so the importance ratio of an on-policy step is exactly 1: the script prints the
largest gap it saw (0.0). It prints the split of time per step and, with ``--plot``, draws the
reward curve.

    python examples/rl_grpo.py --steps 20 --plot reward.png
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.weights.catalog import resolve_model

SHOTS = "2+3=5\n4+1=5\n6+2=8\n"
ANSWER = re.compile(r"(\d+)\n")


def make_prompts(rng: random.Random, count: int, high: int) -> list[tuple[str, int]]:
    """``count`` few-shot sum prompts and their answers."""
    pairs = [(rng.randint(1, high), rng.randint(1, high)) for _ in range(count)]
    return [(f"{SHOTS}{a}+{b}=", a + b) for a, b in pairs]


def reward(text: str, answer: int) -> float:
    """1 for the right number followed by a newline, else 0."""
    found = ANSWER.match(text)
    return 1.0 if found is not None and int(found.group(1)) == answer else 0.0


def accuracy(llm: LLM, tasks: list[tuple[str, int]]) -> float:
    """Greedy exact-answer rate on ``tasks`` (a fixed held-out set: the curve's clean signal)."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = llm.generate([text for text, _ in tasks], params, use_tqdm=False)
    return sum(
        reward(o.outputs[0].text, answer) for o, (_, answer) in zip(outputs, tasks, strict=True)
    ) / len(tasks)


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prompt_ids: list[list[int]],
    outputs: list,
    rewards: torch.Tensor,
    clip: float,
    invariant: bool,
) -> tuple[float, float]:
    """One GRPO update from a step's rollouts; returns (loss, the largest gap between the
    training forward's logprob and the rollout's for the same tokens)."""
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    rows, old, adv, spans = [], [], [], []
    for prompt, out, a in zip(prompt_ids, outputs, advantages, strict=True):
        for completion, advantage in zip(out.outputs, a.tolist(), strict=True):
            tokens = completion.token_ids
            rows.append(prompt + tokens)
            old.append([e[t].logprob for e, t in zip(completion.logprobs, tokens, strict=True)])
            adv.append(advantage)
            spans.append((len(prompt), len(tokens)))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    logp = model(ids, attention_mask=mask, batch_invariant=invariant).logits.log_softmax(-1)
    losses, gap = [], 0.0
    for i, (start, count) in enumerate(spans):
        if count == 0:
            continue
        positions = torch.arange(start - 1, start - 1 + count)
        new = logp[i, positions, ids[i, start : start + count]]
        before = torch.tensor(old[i])
        gap = max(gap, float((new.detach() - before).abs().max()))
        ratio = torch.exp(new - before)
        unclipped = ratio * adv[i]
        clipped = ratio.clamp(1 - clip, 1 + clip) * adv[i]
        losses.append(-torch.minimum(unclipped, clipped).mean())
    loss = torch.stack(losses).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach()), gap


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--high", type=int, default=9, help="the largest addend")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--eval-every", type=int, default=5, help="greedy accuracy on held-out sums every N steps"
    )
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--log", type=Path, default=None, help="write each step's figures as JSON lines")
    parser.add_argument("--plot", type=Path, default=None, help="draw the reward curve to this PNG")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = load_model(args.model, requires_grad=True)
    llm = LLM.from_model(model, tokenizer=resolve_model(args.model), batch_invariant=args.batch_invariant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    held_out = make_prompts(random.Random(args.seed + 1), args.eval_prompts, args.high)
    history: list[dict] = []
    for step in range(args.steps):
        evaluated = None
        if args.eval_every and step % args.eval_every == 0:
            evaluated = accuracy(llm, held_out)
        tasks = make_prompts(rng, args.prompts, args.high)
        prompt_ids = [llm.tokenizer(text).input_ids for text, _ in tasks]
        params = SamplingParams(
            n=args.group, temperature=1.0, max_tokens=4, logprobs=0, seed=rng.randrange(2**31)
        )
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        rollout_s = time.perf_counter() - start
        rewards = torch.tensor(
            [
                [reward(c.text, answer) for c in out.outputs]
                for out, (_, answer) in zip(outputs, tasks, strict=True)
            ]
        )
        start = time.perf_counter()
        loss, gap = grpo_step(model, optimizer, prompt_ids, outputs, rewards, args.clip, args.batch_invariant)
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.sync_weights()
        sync_s = time.perf_counter() - start
        row = {
            "step": step,
            "reward": float(rewards.mean()),
            "loss": loss,
            "logprob_gap": gap,
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "weight_version": outputs[0].weight_version,
            "held_out_accuracy": evaluated,
        }
        history.append(row)
        held = f"  held-out accuracy {evaluated:.3f}" if evaluated is not None else ""
        print(
            f"step {step:3d}  reward {row['reward']:.3f}  loss {loss:+.2e}  logprob gap {gap:.2e}  "
            f"rollout {rollout_s:.2f}s  train {train_s:.2f}s  sync {sync_s * 1e3:.1f}ms{held}",
            flush=True,
        )
        if args.log is not None:
            with args.log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if args.eval_every:
        final = accuracy(llm, held_out)
        history[-1]["final_held_out_accuracy"] = final
        print(f"after {args.steps} steps: held-out accuracy {final:.3f}", flush=True)
    if args.plot is not None:
        plot_rewards(history, args.plot)
    return history


def plot_rewards(history: list[dict], path: Path) -> None:
    """The mean reward per step, its running mean over five steps, and the held-out accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    rewards = [r["reward"] for r in history]
    smooth = [
        sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, "o", alpha=0.4, label="mean reward of the step")
    ax.plot(steps, smooth, "-", label="running mean (5 steps)")
    held = [(r["step"], r["held_out_accuracy"]) for r in history if r.get("held_out_accuracy") is not None]
    if "final_held_out_accuracy" in history[-1]:
        held.append((history[-1]["step"] + 1, history[-1]["final_held_out_accuracy"]))
    if held:
        ax.plot([s for s, _ in held], [a for _, a in held], "s--", label="greedy accuracy, held-out sums")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (exact sums)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
