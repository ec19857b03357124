"""Config fuzzer (docs/contributing.md): random valid model configs and random workloads.

For each generated config and workload:
- the reference: every request's chosen-token logprobs (prefill, then incremental decode over
  the engine's tokens) equal the reference's within ``TOL`` and its tokens are the
  reference's argmax except at near-ties: transformers with its own cache for V4 (indexer
  top-k patched to the model's tie rule, tests/support/stable_topk_patch.py) and Llama, the dense
  spec re-implementation ``v41_reference.py`` for V4.1;
- the engine: each request alone == all of them batched in a random order == prefill chunked
  at a random budget == preempted by a small cache == served again from the prefix cache;
  tokens identical, chosen-token logprobs within ``TOL``. V4.1 runs without its QAT rounding
  (``fake_quant=False``): rounding turns the last-bit differences of other matrix shapes into
  whole grid steps, which only a batch-invariant mode can rule out.

CI runs a fixed set (``ci_set``: a config of every ``COVERAGE`` shape by construction, then
derandomized draws); ``DEEPINFER_FUZZ_EXAMPLES=N`` runs N hypothesis examples per family with
fresh randomness (``DEEPINFER_FUZZ_SEED`` to replay one run).
"""

from __future__ import annotations

import functools
import math
import os
import random
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from equivalence_workloads import count_preemptions
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from stable_topk_patch import stable_indexer_topk

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

TOL = 1e-4
NEAR_TIE = 1e-4
PREEMPTED_RUNS: Counter[bool] = Counter()  # did the "preempted" run preempt (reported, checked below)
LONG_FUZZ = int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int):
    return settings(
        max_examples=LONG_FUZZ or ci_examples,
        derandomize=not LONG_FUZZ,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),  # each example costs seconds: no shrinking
        suppress_health_check=list(HealthCheck),
    )


# ---- configs ----------------------------------------------------------------------------

V4_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


@st.composite
def v4_configs(draw) -> dict:
    """Layer kinds in any order (the first layer included), hash-routed layers anywhere,
    HCA ratios 8/16/128, windows, index top-k below and above the entry count, few index
    heads (exact-zero score ties), query heads and output groups, experts and top-k."""
    n = draw(st.integers(2, 5))
    heads = draw(st.sampled_from([2, 4, 8]))
    experts = draw(st.sampled_from([4, 8]))
    return {
        "num_hidden_layers": n,
        "layer_types": draw(st.lists(st.sampled_from(V4_KINDS), min_size=n, max_size=n)),
        "mlp_layer_types": draw(st.lists(st.sampled_from(["hash_moe", "moe"]), min_size=n, max_size=n)),
        "compress_rates": {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": draw(st.sampled_from([8, 16, 128])),
        },
        "sliding_window": draw(st.sampled_from([4, 8, 16, 32])),
        "index_topk": draw(st.sampled_from([1, 2, 3, 5, 8, 64])),
        "index_n_heads": draw(st.sampled_from([1, 2, 8])),
        "num_attention_heads": heads,
        "o_groups": draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),
        "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(3, experts))),
    }


@st.composite
def v41_plans(draw) -> dict:
    """A random valid V4.1 layer plan (the rules ``layer_plan`` checks): ratios 0/1/2 per layer; a
    compressed layer whose ratio differs from the nearest KV source before it becomes a
    source itself, any other may; index sources are the KV sources plus any compressed
    layers that re-index; an optional candidate source among the KV sources (kept only when
    every later re-indexing layer shares its ratio); Engram on layers 1 and 3 or off; DSpark
    reads three distinct layers."""
    n = draw(st.integers(2, 6))
    ratios = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=n, max_size=n))
    if not any(ratios):
        ratios[draw(st.integers(0, n - 1))] = draw(st.sampled_from([1, 2]))
    kv_sources, index_sources, current = [], [], None
    for i, r in enumerate(ratios):
        if not r:
            continue
        if current is None or ratios[current] != r or draw(st.booleans()):
            kv_sources.append(i)
            index_sources.append(i)
            current = i
        elif draw(st.booleans()):
            index_sources.append(i)  # re-indexes inside its source's entries
    candidate = draw(st.sampled_from([None, *kv_sources]))
    if candidate is not None and any(i > candidate and ratios[i] != ratios[candidate] for i in index_sources):
        candidate = None
    engram = n >= 4 and draw(st.booleans())
    return {
        "num_hidden_layers": n,
        "compress_ratios": ratios + [0, 0, 0],  # the three DSpark stages: sliding only
        "kv_source_layer_ids": kv_sources,
        "index_source_layer_ids": index_sources,
        "candidate_source_layer_id": candidate,
        "engram_layer_ids": [1, 3] if engram else [],
        "engram_num_embeddings": [152, 220] if engram else [],
        "dspark_target_layer_ids": sorted(
            draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True))
        ),
    }


@st.composite
def v41_configs(draw) -> dict:
    """A random layer plan with windows, top-k, candidate blocks and index heads drawn."""
    return {
        **draw(v41_plans()),
        "sliding_window": draw(st.sampled_from([4, 8, 16])),
        "index_topk": draw(st.sampled_from([1, 2, 3, 4, 8, 1024])),
        "candidate_topk_blocks": draw(st.sampled_from([1, 2, 3, 1024])),
        "candidate_block_size": draw(st.sampled_from([2, 4, 8])),
        "index_n_heads": draw(st.sampled_from([1, 2])),
    }


@st.composite
def llama_configs(draw) -> dict:
    kv = draw(st.sampled_from([1, 2, 4]))
    return {
        "num_hidden_layers": draw(st.integers(1, 3)),
        "num_attention_heads": kv * draw(st.sampled_from([1, 2])),
        "num_key_value_heads": kv,
        "tie_word_embeddings": draw(st.booleans()),
    }


# ---- workloads --------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    order: list[int]  # the batched run's submission order
    chunk_budget: int
    block_size: int  # the chunked run's cache block (rounded up to a multiple of every ratio)

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens[i], temperature=0.0, ignore_eos=True, logprobs=1)


def make_workload(seed: int, longest: int) -> Workload:
    """Prompts of 1..longest tokens (every other one sharing a prefix, so the prefix cache
    hits), 1-8 tokens out each, a random submission order and chunk budget."""
    rng = random.Random(seed)
    n = rng.randrange(3, 8)
    prefix = [rng.randrange(2, 250) for _ in range(rng.randrange(longest // 3, longest // 2 + 2))]
    prompts = []
    for i in range(n):
        if i % 2:
            prompts.append(prefix + [rng.randrange(2, 250) for _ in range(rng.randrange(1, longest // 2))])
        else:
            prompts.append([rng.randrange(2, 250) for _ in range(rng.randrange(1, longest + 1))])
    order = list(range(n))
    rng.shuffle(order)
    max_tokens = [rng.randrange(1, 9) for _ in range(n)]
    return Workload(prompts, max_tokens, order, rng.randrange(5, 49), rng.choice([16, 32, 64]))


def workloads(longest: int) -> st.SearchStrategy[Workload]:
    return st.integers(0, 2**32 - 1).map(lambda seed: make_workload(seed, longest))


# ---- runs -------------------------------------------------------------------------------

Result = tuple[list[int], list[float]]  # tokens, chosen-token logprobs


def _result(out) -> Result:
    c = out.outputs[0]
    return list(c.token_ids), [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]


def _generate(llm: LLM, work: Workload, indices: list[int]) -> dict[int, Result]:
    outs = llm.generate([work.prompts[i] for i in indices], [work.params(i) for i in indices], use_tqdm=False)
    engine = llm.engine
    assert engine.block_pools[0].num_free == engine.num_blocks or engine.config.enable_prefix_caching, (
        "blocks leaked"
    )
    return {i: _result(o) for i, o in zip(indices, outs, strict=True)}


def _force_preemptions(llm: LLM, rng: random.Random) -> list[str]:
    """Preempt by recompute as a full cache would: before about a third of the steps, one
    running request (drawn by ``rng``) loses its blocks and starts over. The cache is also
    sized for the longest request alone, so real preemptions happen as well. Returns the
    preempted request ids as they happen."""
    scheduler = llm.engine.scheduler
    preemptions = count_preemptions(llm)
    schedule = scheduler.schedule

    def schedule_with_preemptions(drafts=None):
        if scheduler.running and rng.random() < 0.3:
            scheduler.preempt(rng.choice(scheduler.running))
        return schedule(drafts)

    scheduler.schedule = schedule_with_preemptions
    return preemptions


def engine_modes(ckpt: Path, work: Workload, **options) -> dict[str, dict[int, Result]]:
    """The workload alone; batched (asynchronous scheduling); chunked (another block size);
    preempted (forced, and a cache that holds only the longest request); prefix-cached. ``options``:
    more engine options for every run."""
    n = len(work.prompts)
    base = {"async_scheduling": False, "max_num_batched_tokens": 4096, **options}
    alone_llm = LLM(ckpt, enable_prefix_caching=False, **base)
    runs = {"alone": {}}
    for i in range(n):
        runs["alone"].update(_generate(alone_llm, work, [i]))
    block = alone_llm.engine.layout.block_size
    batched = LLM(ckpt, enable_prefix_caching=False, max_num_seqs=n, **{**base, "async_scheduling": True})
    runs["batched"] = _generate(batched, work, work.order)
    chunked = LLM(
        ckpt,
        enable_prefix_caching=False,
        **{**base, "max_num_batched_tokens": work.chunk_budget, "block_size": work.block_size},
    )
    runs["chunked"] = _generate(chunked, work, work.order)
    longest = max(len(p) + m for p, m in zip(work.prompts, work.max_tokens, strict=True))
    tight = LLM(ckpt, enable_prefix_caching=False, num_cache_blocks=math.ceil(longest / block), **base)
    preemptions = _force_preemptions(tight, random.Random(work.chunk_budget))
    runs["preempted"] = _generate(tight, work, work.order)
    PREEMPTED_RUNS[bool(preemptions)] += 1
    cached = LLM(ckpt, enable_prefix_caching=True, max_num_seqs=n, **{**base, "max_num_batched_tokens": 64})
    _generate(cached, work, work.order)  # fills the cache
    runs["cached"] = _generate(cached, work, list(range(n)))
    if max(len(p) for p in work.prompts) > block:  # a hit leaves at least one token to compute
        assert cached.engine.block_pools[0].hit_blocks > 0, (
            "the second pass found nothing in the prefix cache"
        )
    return runs


def assert_modes_equal_alone(runs: dict[str, dict[int, Result]]) -> None:
    alone = runs["alone"]
    for mode, results in runs.items():
        for i, (tokens, logprobs) in results.items():
            assert tokens == alone[i][0], f"{mode}: request {i} tokens {tokens} != alone {alone[i][0]}"
            diff = max((abs(a - b) for a, b in zip(logprobs, alone[i][1], strict=True)), default=0.0)
            assert diff <= TOL, f"{mode}: request {i} logprobs moved by {diff:.2e}"


def assert_matches_reference(alone: dict[int, Result], reference_rows, work: Workload) -> None:
    """``reference_rows(prompt, tokens)`` gives the reference's log-softmax rows [len(tokens), V]
    predicting each generated token."""
    for i, (tokens, logprobs) in alone.items():
        rows = reference_rows(work.prompts[i], tokens)
        ref = rows.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        diff = (ref - torch.tensor(logprobs)).abs().max().item()
        assert diff <= TOL, f"request {i}: logprobs differ from the reference by {diff:.2e}"
        top2 = rows.topk(2, dim=-1).values
        for step, token in enumerate(tokens):
            near_tie = top2[step, 0] - top2[step, 1] < NEAR_TIE
            assert token == int(rows[step].argmax()) or near_tie, f"request {i} step {step}: not the argmax"


def hf_incremental_rows(model):
    """Log-softmax rows of a transformers model fed the prompt, then each token with its own
    cache (the incremental decode path)."""

    def rows(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([prompt]), use_cache=True)
            logits, past = [out.logits[0, -1]], out.past_key_values
            for t in tokens[:-1]:
                out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                logits.append(out.logits[0, -1])
                past = out.past_key_values
        return torch.log_softmax(torch.stack(logits).float(), dim=-1)

    return rows


def _hf_model(ckpt: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


# ---- the fuzz tests ---------------------------------------------------------------------


# CI runs a fixed set of configs per family (``ci_set``); DEEPINFER_FUZZ_EXAMPLES=N runs N
# fresh hypothesis examples per family instead
CI_EXAMPLES = {"v4": 40, "v41": 12, "llama": 12}
ci_only = pytest.mark.skipif(bool(LONG_FUZZ), reason="DEEPINFER_FUZZ_EXAMPLES runs fresh examples instead")
long_only = pytest.mark.skipif(not LONG_FUZZ, reason="CI runs the fixed set (test_fuzz_ci_set)")


def v4_longest(config: dict) -> int:
    return min(2 * config["compress_rates"]["heavily_compressed_attention"] + 8, 150)


@long_only
@fuzz_settings(ci_examples=CI_EXAMPLES["v4"])
@given(config=v4_configs(), data=st.data())
def test_fuzz_deepseek_v4(config, data):
    check_v4(config, data.draw(workloads(longest=v4_longest(config))))


def check_v4(config: dict, work: Workload) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "v4", arch="deepseek_v4_short_groups", **config)
        runs = engine_modes(ckpt, work)
        assert_modes_equal_alone(runs)
        hf = stable_indexer_topk(_hf_model(ckpt))
        assert_matches_reference(runs["alone"], hf_incremental_rows(hf), work)


@long_only
@fuzz_settings(ci_examples=CI_EXAMPLES["llama"])
@given(config=llama_configs(), data=st.data())
def test_fuzz_llama(config, data):
    check_llama(config, data.draw(workloads(longest=80)))


def check_llama(config: dict, work: Workload) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "llama", arch="llama", **config)
        runs = engine_modes(ckpt, work)
        assert_modes_equal_alone(runs)
        assert_matches_reference(runs["alone"], hf_incremental_rows(_hf_model(ckpt)), work)


@long_only
@fuzz_settings(ci_examples=CI_EXAMPLES["v41"])
@given(config=v41_configs(), data=st.data())
def test_fuzz_deepseek_v41(config, data):
    check_v41(config, data.draw(workloads(longest=60)))


def check_v41(config: dict, work: Workload) -> None:
    from v41_reference import read_checkpoint, reference_logits

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "v41", arch="deepseek_v41", **config)
        runs = engine_modes(ckpt, work, fake_quant=False)
        assert_modes_equal_alone(runs)
        ref = read_checkpoint(ckpt)

        def rows(prompt: list[int], tokens: list[int]) -> torch.Tensor:
            ids = torch.tensor([prompt + tokens[:-1]])
            logits = reference_logits(ref, ids, fake_quant=False)
            return torch.log_softmax(logits[0, len(prompt) - 1 :].float(), dim=-1)

        assert_matches_reference(runs["alone"], rows, work)


COVERAGE = {
    "v4": [
        lambda c: c["layer_types"][0] != "sliding_attention" and c["mlp_layer_types"][0] == "hash_moe",
        lambda c: c["layer_types"].count("heavily_compressed_attention") >= 2,
        lambda c: c["index_topk"] < 4 and c["index_n_heads"] == 1,
        lambda c: c["index_topk"] == 64,
    ],
    "v41": [
        lambda c: bool(c["engram_layer_ids"]),
        lambda c: not c["engram_layer_ids"],
        lambda c: c["candidate_source_layer_id"] is not None,
        lambda c: len(c["kv_source_layer_ids"]) >= 2,
        lambda c: len(c["index_source_layer_ids"]) > len(c["kv_source_layer_ids"]),
        lambda c: c["compress_ratios"][0] > 0,
    ],
    "llama": [
        lambda c: c["num_attention_heads"] > c["num_key_value_heads"],
        lambda c: not c["tie_word_embeddings"],
    ],
}
STRATEGIES = {"v4": v4_configs, "v41": v41_configs, "llama": llama_configs}
CHECKS = {"v4": check_v4, "v41": check_v41, "llama": check_llama}
LONGEST = {"v4": v4_longest, "v41": lambda _: 60, "llama": lambda _: 80}


@functools.cache
def ci_set(family: str) -> tuple[dict, ...]:
    """The configs CI runs, by construction holding every ``COVERAGE`` shape: for each shape
    the simplest config of it (found by a derandomized search), then derandomized draws up to
    ``CI_EXAMPLES``."""
    strategy = STRATEGIES[family]()
    search = settings(
        max_examples=2000, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    found = [find(strategy, wanted, settings=search) for wanted in COVERAGE[family]]
    drawn: list[dict] = []

    @settings(
        max_examples=CI_EXAMPLES[family] - len(found),
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(config: dict) -> None:
        drawn.append(config)

    collect()
    return tuple(found + drawn)


@ci_only
@pytest.mark.parametrize(
    ("family", "case"), [(f, i) for f in sorted(CI_EXAMPLES) for i in range(CI_EXAMPLES[f])]
)
def test_fuzz_ci_set(family, case):
    """One config of the fixed set, with its own workload (seeded by its place in the set)."""
    config = ci_set(family)[case]
    seed = random.Random(f"{family}/{case}").randrange(2**32)
    CHECKS[family](config, make_workload(seed, LONGEST[family](config)))


@pytest.mark.parametrize("family", sorted(COVERAGE))
def test_fuzz_covers_what_it_claims(family):
    """Guards the generators: each shape the fuzzer is for can be drawn."""
    strategy = STRATEGIES[family]()
    for wanted in COVERAGE[family]:
        find(strategy, wanted, settings=settings(max_examples=2000, database=None))


@pytest.mark.parametrize("family", sorted(COVERAGE))
def test_the_ci_set_holds_every_shape(family):
    """The fixed set CI runs holds every ``COVERAGE`` shape and ``CI_EXAMPLES`` configs, each
    a config the generators can draw (the same keys)."""
    configs = ci_set(family)
    assert len(configs) == CI_EXAMPLES[family]
    keys = set(configs[-1])
    assert all(set(c) == keys for c in configs)
    for i, wanted in enumerate(COVERAGE[family]):
        assert any(wanted(c) for c in configs), f"{family}: no config of shape {i}"


# ---- regressions the fuzzer found (each failed before the tie rule, models/layers/topk.py) ----

REGRESSIONS = {
    # a ratio-128 first layer, hash-routed, one index head: ReLU ties at the top-k boundary
    "hca_first_layer_hash_routed": {
        "num_hidden_layers": 2,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "hash_moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": 4,
        "index_topk": 8,
        "index_n_heads": 1,
        "num_attention_heads": 4,
        "o_groups": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    },
    # a compressed, hash-routed first layer, two HCA layers, index_topk 3 below the entries
    "csa_first_layer_two_hca_small_topk": {
        "num_hidden_layers": 4,
        "layer_types": [
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
            "heavily_compressed_attention",
        ],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 8,
        "index_topk": 3,
        "index_n_heads": 1,
        "num_attention_heads": 8,
        "o_groups": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
    },
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_fuzz_regression(name):
    config = REGRESSIONS[name]
    hca = config["compress_rates"]["heavily_compressed_attention"]
    before = PREEMPTED_RUNS[True]
    check_v4(config, make_workload(0, min(2 * hca + 8, 150)))
    assert PREEMPTED_RUNS[True] == before + 1, "the preempted run did not preempt"


def test_a_request_that_ends_with_its_prefill_still_shares_its_prompt(tmp_path):
    """Found by the fuzzer: blocks were published only for requests still running after a
    step, so a prompt whose request finished at its first token (max_tokens=1, a stop
    token) never reached the prefix cache."""
    ckpt = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4_short_groups")
    llm = LLM(ckpt, async_scheduling=False)
    prompt = list(range(3, 3 + llm.engine.layout.block_size + 5))
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert again[0].num_cached_tokens == llm.engine.layout.block_size
    assert again[0].outputs[0].token_ids[:1] == first[0].outputs[0].token_ids
