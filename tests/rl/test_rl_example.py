"""``examples/rl_grpo.py`` in a short run on SmolLM2: every step generates from the module being
trained (the outputs' weight version moves on with each step), the rollout's logprobs equal
the training forward's exactly under ``batch_invariant``, the time split is reported, and one
GRPO step raises its objective: the rewarded completions gain probability against the others."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.weights.catalog import resolve_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("rl_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_grpo"] = module
    spec.loader.exec_module(module)
    return module


def test_a_short_run_generates_from_the_trained_module(tmp_path):
    example = _example()
    log, plot = tmp_path / "log.jsonl", tmp_path / "reward.png"
    history = example.main(
        ["--steps", "2", "--prompts", "2", "--group", "3", "--log", str(log), "--plot", str(plot)]
    )
    assert [row["weight_version"] for row in history] == ["0", "1"]
    assert all(row["logprob_gap"] == 0.0 for row in history)
    assert all(0.0 <= row["reward"] <= 1.0 and row["sync_s"] >= 0 for row in history)
    assert len(log.read_text().splitlines()) == 2 and plot.stat().st_size > 0


def test_a_grpo_step_moves_probability_towards_the_rewarded_completions():
    example = _example()
    model = load_model("smollm2-135m", requires_grad=True)
    llm = LLM.from_model(model, tokenizer=resolve_model("smollm2-135m"), batch_invariant=True)
    tasks = example.make_prompts(random.Random(3), 2, 9)
    prompt_ids = [llm.tokenizer(text).input_ids for text, _ in tasks]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=4, logprobs=0, seed=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    # rewards by hand, so that every group has winners and losers
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])

    def completion_logp() -> torch.Tensor:
        """Each completion's mean token logprob (what the GRPO loss weighs)."""
        out = []
        with torch.no_grad():
            for prompt, o in zip(prompt_ids, outputs, strict=True):
                for c in o.outputs:
                    ids = torch.tensor([prompt + c.token_ids])
                    logp = model(ids, batch_invariant=True).logits.log_softmax(-1)[0]
                    idx = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(c.token_ids))
                    out.append(logp[idx, ids[0, len(prompt) :]].mean())
        return torch.stack(out).view(2, 4)

    before = completion_logp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    _, gap = example.grpo_step(model, optimizer, prompt_ids, outputs, rewards, 0.2, True)
    assert gap == 0.0
    moved = completion_logp() - before
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    assert float((advantages * moved).sum()) > 0  # the objective rose
    assert float(moved[rewards == 1].mean()) > float(moved[rewards == 0].mean())
