"""One check of a drafter, shared by the CUDA run (test_cuda_paths.py) and its CPU test
(tests/sampling/test_drafter_check.py): greedy decoding with speculation must draft, and
must give the plain engine's tokens.

Drafting needs requests the speculative decoder will draft for: no logprobs (``can_draft``
refuses a request that asks for them, since drafts are verified against the plain
distribution), and ``adaptive`` off (in ``LLM.generate``'s closed batch of equal budgets the
adaptive rule verifies drafts only for requests that could finish last, which can be none of
them). Prompts repeat a short motif, so n-gram lookups find matches and a random tiny model's
own drafters are right often enough to be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec_prompts import repeating_prompts  # tests/support, on pytest's path

from deepinfer import LLM, SamplingParams

# the drafter each tiny architecture has: MTP heads on V4, DSpark's block on V4.1, n-gram anywhere
METHODS = {"deepseek_v41": "dspark", "deepseek_v4": "mtp", "llama": "ngram"}


@dataclass
class DrafterResult:
    plain: list  # RequestOutputs of the engine without speculation (top-2 logprobs per step)
    spec: list  # RequestOutputs of the speculative engine
    drafted: int  # drafted tokens verified by the target
    accepted: int

    def tokens(self, which: str) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in getattr(self, which)]


def check_drafter(
    path: Any,
    method: str,
    device: str = "cpu",
    *,
    num_prompts: int = 8,
    max_tokens: int = 24,
    logprobs: int | None = None,
    adaptive: bool = False,
    **engine: Any,
) -> DrafterResult:
    """Greedy outputs of the plain engine and of a speculative one (eager steps: the
    drafting logic is what is checked) on repeating prompts. ``logprobs``/``adaptive`` are
    the speculative requests' options; their defaults are the ones under which it drafts.
    The plain run asks for top-2 logprobs, so a divergence can be told from a near-tie."""
    prompts = repeating_prompts(num_prompts, repeats=16, lengths=(12, 48))
    kw = {"device": device, "max_num_seqs": num_prompts, "compile": False, "capture_graphs": False, **engine}
    ref_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(path, **kw).generate(prompts, ref_params, use_tqdm=False)
    config = {"method": method, "adaptive": adaptive}
    llm = LLM(path, speculative_config=config, **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    spec = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.spec.stats
    return DrafterResult(plain, spec, stats.drafted, stats.accepted)
