"""The DSpark head ``deepinfer train-drafter smollm2-135m`` trained, serving SmolLM2-135M:
greedy outputs equal plain decoding on held-out chat prompts, and sampled outputs keep the
target's distribution at drafted positions (mutation: a verifier that accepts every draft).

Training one takes far longer than the suite may, so a fresh checkout has no such head:
these tests run where it is in the cache and are skipped, saying so, where it is not. The
same checks run on random and briefly trained heads in every run (test_dspark_head.py,
test_drafter_training.py).
"""

from __future__ import annotations

import pytest
from chi_square import conditional_p_value, exact_next_token
from mutations import accept_every_draft

from deepinfer import LLM, SamplingParams
from deepinfer.drafter_training.prompts import chat_prompts
from deepinfer.weights.catalog import SMOLLM2, draft_head_dir, resolve_model

HEAD = f"{SMOLLM2}-dspark"
pytestmark = pytest.mark.skipif(
    not (draft_head_dir(SMOLLM2) / "model.safetensors").is_file(),
    reason=f"no trained head in the cache: run `deepinfer train-drafter {SMOLLM2}` first",
)


def test_greedy_outputs_equal_plain_decoding_on_chat_prompts():
    convs = chat_prompts(6, seed=3, held_out=True)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = [o.outputs[0].token_ids for o in LLM(SMOLLM2, max_num_seqs=4).chat(convs, params, use_tqdm=False)]
    llm = LLM(
        SMOLLM2, max_num_seqs=4, speculative_config={"method": "dspark", "model": HEAD, "adaptive": False}
    )
    assert [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)] == plain
    stats = llm.engine.spec.stats
    assert stats.accepted > 0 and stats.mean_acceptance_length > 1.5  # a trained head drafts well


def _p_value(broken: bool, monkeypatch) -> tuple[float, object]:
    """Seeded samples of one chat prompt at temperature 0.8: the tokens at positions 1 and 2
    (drafted and verified), given the tokens before them, follow the target's exact
    conditionals (one-sample chi-square over groups of at least 40 samples)."""
    if broken:
        accept_every_draft(monkeypatch)
    n, temperature = 600, 0.8
    spec = {"method": "dspark", "model": HEAD, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(SMOLLM2, max_num_seqs=64, speculative_config=spec)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a color."}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)
    ]
    outs = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    ]
    p, used = conditional_p_value(outs, (1, 2), exact_next_token(resolve_model(SMOLLM2), prompt, temperature))
    assert used >= n // 3, f"only {used} samples fell in groups large enough to test"
    return p, llm.engine.spec.stats


def test_sampled_tokens_keep_the_target_distribution(monkeypatch):
    p, stats = _p_value(False, monkeypatch)
    assert 0 < stats.accepted < stats.drafted
    assert p > 1e-3, p


def test_a_verifier_accepting_everything_fails(monkeypatch):
    p, _ = _p_value(True, monkeypatch)
    assert p < 1e-6, p
