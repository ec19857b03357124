"""``batch_invariant=True``: a request's logprobs are bit-identical alone, in a batch of 32
random others at a random position, and with its prefill chunked by a random small token
budget, on tiny V4 and V4.1 and on SmolLM2; seeded temperature-1 sampling draws the same
tokens in all three. Mutation check: the default engine is not bit-identical on a fixed case,
so the comparison can fail."""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

OTHERS = 32


def _checkpoint(arch: str, tmp_path_factory) -> str:
    if arch == "smollm2":
        return "smollm2-135m"
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, seed=21))


class _Engines:
    """The engines of one test, by token budget: the alone and batched placements share the
    budget-512 engine, and examples share it too (a SmolLM2 engine takes seconds to build).
    Its computed cache is forgotten before every run, so no placement reads another's KV
    blocks: each computes its prefill as a fresh engine would. At most two are held: the
    512 one and the latest small-budget one."""

    def __init__(self, path: str, invariant: bool) -> None:
        self.path, self.invariant = path, invariant
        self._held: dict[int, LLM] = {}

    def get(self, budget: int) -> LLM:
        if budget not in self._held:
            for old in [b for b in self._held if b != 512]:
                self._drop(old)
            self._held[budget] = LLM(
                self.path,
                batch_invariant=self.invariant,
                max_num_batched_tokens=budget,
                max_num_seqs=OTHERS + 1,
            )
        llm = self._held[budget]
        llm.engine.forget_computed_cache()
        return llm

    def _drop(self, budget: int) -> None:
        """Each holds a packed copy of the model until collected."""
        self._held.pop(budget).close()
        gc.collect()

    def close(self) -> None:
        for budget in list(self._held):
            self._drop(budget)


def _target_output(llm: LLM, target, params, others, position):
    """The target request's tokens and its top-5 logprobs per token."""
    if position is None:
        out = llm.generate([target], [params], use_tqdm=False)[0]
    else:
        prompts = others[:position] + [target] + others[position:]
        rest = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
        plist = [rest] * position + [params] + [rest] * (len(others) - position)
        out = llm.generate(prompts, plist, use_tqdm=False)[position]
    completion = out.outputs[0]
    return completion.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in completion.logprobs]


# Generated examples per model: hypothesis's first is its minimal one (seed 0, position 0,
# budget 32), the rest random; every example runs the same three placements through the same
# code, only the prompts, the target's place and the small budget differ. The explicit example
# below fixes the other ends of those ranges (the target last, scheduled behind every other
# prompt's prefill, and a small budget off the 32-position grid), so two generated ones
# suffice; the batched placement costs most (on V4 and V4.1 a forward per chunk).
EXAMPLES = {"deepseek_v4": 2, "deepseek_v41": 2, "smollm2": 2}


def _case(seed: int, position: int, small_budget: int):
    """A target prompt, 32 others, the target's sampling params and the three placements."""
    rng = random.Random(seed)
    vocab = 250
    target = [rng.randrange(2, vocab) for _ in range(rng.randrange(40, 90))]
    others = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 90))] for _ in range(OTHERS)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, logprobs=5, ignore_eos=True)
    runs = {
        "alone": (512, None),
        "batched": (512, position),
        "chunked": (small_budget, None),
    }
    return target, others, params, runs


def _outputs(engines: _Engines, seed: int, position: int, small_budget: int) -> dict:
    target, others, params, runs = _case(seed, position, small_budget)
    return {name: _target_output(engines.get(b), target, params, others, p) for name, (b, p) in runs.items()}


ARCHS = ["deepseek_v4", "deepseek_v41", "smollm2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_do_not_depend_on_the_batch(tmp_path_factory, arch):
    engines = _Engines(_checkpoint(arch, tmp_path_factory), invariant=True)

    @settings(max_examples=EXAMPLES[arch], deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16), position=st.integers(0, OTHERS), small_budget=st.integers(32, 48))
    @example(seed=7, position=OTHERS, small_budget=45)
    def check(seed, position, small_budget):
        got = _outputs(engines, seed, position, small_budget)
        assert got["alone"] == got["batched"] == got["chunked"]

    try:
        check()
    finally:
        engines.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_default_engine_fails_the_same_comparison(tmp_path_factory, arch):
    """Mutation check, on one fixed case (hypothesis's minimal example): without batch
    invariance the batch moves some logprob, so the comparison above can fail. Fixed, because
    the default engine is bit-identical on many cases (SmolLM2's packed projections are
    batch-invariant by construction: a random case may not tell the two modes apart)."""
    engines = _Engines(_checkpoint(arch, tmp_path_factory), invariant=False)
    try:
        default = _outputs(engines, seed=0, position=0, small_budget=32)
    finally:
        engines.close()
    assert not (default["alone"] == default["batched"] == default["chunked"])


def test_options_that_batch_are_refused(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=1))
    with pytest.raises(ValueError, match="turn compile off"):
        LLM(path, batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 32"):
        LLM(path, batch_invariant=True, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="one rank"):
        LLM(path, batch_invariant=True, data_parallel_size=2)
