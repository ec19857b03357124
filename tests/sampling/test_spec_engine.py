"""Speculative decoding in the engine: greedy outputs equal decoding without it (n-gram on
every model; MTP on V4 and DSpark on V4.1 for the compressor-model paths), seeded sampling
keeps the target distribution, the cache ends as a run without speculation leaves it, and
bad configurations are clear errors. Model drafters' own tests: test_spec_model_drafters.py."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from chi_square import conditional_p_value, exact_next_token
from mutations import accept_every_draft, wrong_from
from rounding import assert_equal_up_to_rounding_flips
from spec_prompts import repeating_prompts

from deepinfer import LLM, SamplingParams
from deepinfer.models.layers.gather import gather_rows
from deepinfer.speculative.ngram import NgramDrafter
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), arch="llama")


def test_greedy_outputs_equal_without_speculation(llama):
    prompts = repeating_prompts(12, 0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        llama, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, max_num_batched_tokens=40
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.spec.stats
    assert stats.verify_steps > 0 and stats.accepted > 0  # tiny random models repeat themselves
    assert stats.engine_steps <= stats.verify_steps and stats.verified_tokens_per_step > 1
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.accepted


class _FixedDrafts(NgramDrafter):
    """Drafts the same tokens after any context: right only sometimes, so both accepted and
    rejected drafts (and their residual resamples) occur."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(len(tokens))
        self.tokens = tokens

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        return list(self.tokens)


def _drafted_positions_p_value(path, broken_verifier: bool, monkeypatch) -> tuple[float, object]:
    """Many seeds of one prompt with speculation: the tokens at drafted positions 1 to 3,
    given the tokens before them, follow the target's exact conditional distribution."""
    prompt, temperature, n = [5, 17, 33, 8, 90, 41, 7, 12], 3.0, 800
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = LLM(path).generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    if broken_verifier:  # mutation: every draft accepted
        accept_every_draft(monkeypatch)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2}, max_num_seqs=64)
    llm.engine.spec.drafter = _FixedDrafts(plain[1:3])
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    p, used = conditional_p_value(outs, (1, 2, 3), exact_next_token(path, prompt, temperature))
    assert used >= n // 2, f"only {used} samples fell in groups large enough to test"
    return p, llm.engine.spec.stats


def test_drafted_positions_keep_the_exact_distribution(llama, monkeypatch):
    """One-sample chi-square at the drafted positions against the target's exact
    conditionals (bins expected >= 5 times), with accepted and rejected drafts."""
    p, stats = _drafted_positions_p_value(llama, False, monkeypatch)
    assert 0 < stats.accepted < stats.drafted
    assert p > 1e-3, p


def test_a_verifier_accepting_everything_fails_the_distribution_test(llama, monkeypatch):
    """Mutation check of the test above."""
    p, _ = _drafted_positions_p_value(llama, True, monkeypatch)
    assert p < 1e-6, p


def _cache_rows(engine, req, n: int, bs: int) -> torch.Tensor:
    """K and V rows of positions 0 .. n-1 of ``req`` in every layer."""
    pos = torch.arange(n)
    flat = torch.tensor(req.block_ids)[pos // bs] * bs + pos % bs
    pools = engine.runner.pools
    return torch.cat([p.window[flat] for p in pools] + [p.values[flat] for p in pools])


def test_cache_after_rejections_equals_a_plain_run(llama):
    """Mid-generation, the cache rows of every computed position hold what a run without
    speculation holds there (rejected drafts' rows lie past the computed count and are
    overwritten later)."""
    prompts = repeating_prompts(3, 1)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    runs = []
    for kw in ({}, {"speculative_config": {"num_speculative_tokens": 5}}):
        engine = LLM(llama, **kw).engine
        if engine.spec is not None:
            engine.spec.drafter = _DivergingOracle([p + o for p, o in zip(prompts, plain, strict=True)], 5, 0)
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while min(len(r.output_token_ids) for r in reqs) < 20:
            engine.step()
        runs.append((engine, reqs))
    (plain, plain_reqs), (spec, spec_reqs) = runs
    stats = spec.spec.stats
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted
    bs = plain.layout.block_size
    for a, b in zip(plain_reqs, spec_reqs, strict=True):
        n = min(a.num_computed_tokens, b.num_computed_tokens)
        assert a.all_token_ids[:n] == b.all_token_ids[:n]
        assert (_cache_rows(plain, a, n, bs) - _cache_rows(spec, b, n, bs)).abs().max() <= 1e-5


ARCH_METHODS = [
    ("deepseek_v4", "ngram"),
    ("deepseek_v41", "ngram"),
    ("deepseek_v4", "mtp"),
    ("deepseek_v41", "dspark"),
]


@pytest.mark.parametrize(("arch", "method"), ARCH_METHODS)
def test_compressor_models_roll_back_rejected_drafts(arch, method, tmp_path):
    """V4/V4.1 compressors keep per-sequence state a rejected draft has advanced: the engine
    restores the slot and recomputes the accepted tokens. Greedy outputs over long generations
    (many groups closing, many rejections) equal plain decoding, with every drafter."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompts = repeating_prompts(6, 11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    # adaptive drafting off: in a closed batch of equal budgets it may verify nothing, and
    # this test is about rolling back rejected drafts
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(path, speculative_config=config, max_num_batched_tokens=48)
    if arch == "deepseek_v41":  # no overlap state: rejections never need a saved copy
        llm.engine.runner.save_slot = None
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == plain
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted < stats.drafted if method == "ngram" else stats.drafted > 0
    assert not llm.engine.spec.rollback.saved


def test_bad_speculative_configs_are_clear_errors(llama):
    with pytest.raises(ValueError, match="needs a DeepSeek-V4.1 model"):
        LLM(llama, speculative_config={"method": "dspark"})
    with pytest.raises(ValueError, match="needs a DeepSeek-V4 model"):
        LLM(llama, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="unknown field"):
        LLM(llama, speculative_config={"tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(llama, speculative_config={"num_speculative_tokens": 0})


class _Oracle(NgramDrafter):
    """Drafts the target's own greedy continuation (known from a plain run)."""

    def __init__(self, sequences: list[list[int]], k: int) -> None:
        super().__init__(k)
        self.sequences, self.k = sequences, k

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        tokens = list(tokens)
        for seq in self.sequences:
            if seq[: len(tokens)] == tokens:
                return seq[len(tokens) : len(tokens) + self.k]
        return []


class _DivergingOracle(_Oracle):
    """The target's greedy continuation, wrong from a random depth on (sometimes never):
    drafts accepted in part, so partial acceptance and its rollback are exercised."""

    def __init__(self, sequences: list[list[int]], k: int, seed: int) -> None:
        super().__init__(sequences, k)
        self.rng = random.Random(seed)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        draft = super().lookup(tokens)
        return wrong_from(draft, self.rng.randrange(len(draft) + 1))


def test_an_oracle_drafter_is_always_accepted(llama):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    llm = LLM(llama, speculative_config={"num_speculative_tokens": 4})
    llm.engine.spec.drafter = _Oracle([p + o for p, o in zip(prompts, plain, strict=True)], 4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.spec.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert stats.mean_acceptance_length > 4  # 4 drafts + the bonus, bar the short tails


def test_speculation_under_preemption_chunking_prefix_caching_and_stops(llama):
    """A tight cache (preemptions), small token budget (chunked prefill, drafts trimmed to the
    budget), shared prefixes (prefix hits) and stop conditions: outputs equal plain decoding
    and nothing leaks."""
    rng = random.Random(5)
    shared = repeating_prompts(1, 9)[0] * 3
    prompts = [shared + p if i % 2 else p for i, p in enumerate(repeating_prompts(16, 7))]
    params = []
    for i in range(len(prompts)):
        stop_ids = [prompts[i][-1]] if i % 3 == 0 else []  # may stop on a drafted token
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(1, 40),
                temperature=0.0,
                stop_token_ids=stop_ids,
                ignore_eos=i % 4 != 0,
            )
        )
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        llama,
        speculative_config={"num_speculative_tokens": 6},
        num_cache_blocks=20,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    engine = llm.engine
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda req: (preempted.append(req.request_id), preempt(req))[1]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == plain
    assert engine.spec.stats.verify_steps > 0 and preempted, "the workload should draft and preempt"
    assert engine.block_pools[0].num_free == engine.num_blocks


@pytest.mark.parametrize("arch", ["deepseek_v4_short_groups", "deepseek_v41"])
def test_drafting_after_a_prefix_hit_that_leaves_one_token(arch, tmp_path):
    """Prompts of one cached block + one token: the first chunk restores the compressor
    overlap from the block's snapshot, then decoding drafts and rolls back on compressor
    models; outputs equal plain decoding."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 5, "adaptive": False})  # drafts verified
    bs = llm.engine.layout.block_size
    rng = random.Random(4)
    prompts = []
    for _ in range(4):
        motif = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 5))]
        prompts.append((motif * (bs // 2 + 2))[: bs + 1])  # one full block + one token
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = llm.generate(prompts, params, use_tqdm=False)  # every prompt's block is cached now
    assert first == plain and [o.outputs[0].token_ids for o in again] == plain
    assert all(o.num_cached_tokens == bs for o in again)
    assert llm.engine.spec.stats.accepted < llm.engine.spec.stats.drafted


def _v4_state(engine, req) -> dict[int, list[torch.Tensor]]:
    """Everything the cache holds for ``req`` that a later step can read, at its computed
    count n: window rows of positions < n, compressed entries and index keys of groups closed
    before n, the slot's partial-group buffer rows of positions in the open group, and the
    overlap (the last closed group)."""
    n = req.num_computed_tokens
    bs = engine.layout.block_size
    table = torch.tensor(req.block_ids)
    if engine.window_block_pools is not None:  # a bounded window holds the last window - 1 positions
        pos = torch.arange(max(0, n - engine.layout.window + 1), n)
        window_rows = torch.tensor(req.window_block_ids)[pos // bs] * bs + pos % bs
    else:
        pos = torch.arange(n)
        window_rows = table[pos // bs] * bs + pos % bs
    rows = [gather_rows(p.window, window_rows) for p in engine.runner.pools]
    for spec, pools in zip(engine.layout.specs, engine.runner.pools, strict=True):
        if spec.ratio and spec.shared_from is None:
            epb = bs // spec.ratio
            j = torch.arange(n // spec.ratio)
            flat = table[j // epb] * epb + j % epb
            rows += [gather_rows(t, flat) for t in (pools.entries, pools.index_keys) if t is not None]
            r, slot = spec.ratio, req.slot
            live = slot * r + torch.arange((n // r) * r, n) % r  # the open group's positions
            for comp in (pools.compressor, pools.indexer):
                if comp is None:
                    continue
                rows += [comp.buf_kv[live], comp.buf_gate[live]]
                if comp.ovl_kv is not None and n >= r:
                    rows += [comp.ovl_kv[slot * r : slot * r + r], comp.ovl_gate[slot * r : slot * r + r]]
    return {n: rows}


def _trace_states(llm, prompt, params) -> dict[int, list[torch.Tensor]]:
    engine = llm.engine
    req = engine.add_request("r", prompt, params)
    states = {}
    while engine.has_unfinished():
        engine.step()
        if not req.finished:
            states.update(_v4_state(engine, req))
    return states


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("deepseek_v4_short_groups", "ngram"),
        ("deepseek_v41", "ngram"),
        ("deepseek_v4_short_groups", "mtp"),
        ("deepseek_v41", "dspark"),
    ],
)
def test_compressor_caches_after_rejections_equal_a_plain_run(arch, method, tmp_path):
    """Whenever the drafted run has computed n positions, its cache (window rows, entries,
    index keys, the slot's compressor buffers and overlap) equals the plain run's at n."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompt = repeating_prompts(1, 2)[0] + [9, 9, 9, 9]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _trace_states(LLM(path, enable_prefix_caching=False), prompt, params)
    spec_llm = LLM(
        path, enable_prefix_caching=False, speculative_config={"method": method, "num_speculative_tokens": 4}
    )
    drafted = _trace_states(spec_llm, prompt, params)
    stats = spec_llm.engine.spec.stats
    assert stats.accepted < stats.drafted, "the run should reject some drafts"
    common = sorted(set(plain) & set(drafted))
    assert len(common) >= 5
    for n in common:  # V4.1 rounds its caches (QAT): a drafted step's shapes may flip a step
        for a, b in zip(plain[n], drafted[n], strict=True):
            assert_equal_up_to_rounding_flips(a, b, 1e-5, f"computed {n}")


def test_hardware_schedule_verifies_less_as_concurrency_grows(llama):
    """Algorithm 1 in the engine with a synthetic steps-per-second table (fast up to 16
    tokens, half as fast beyond; the engine's own step times are not fitted here): one
    request verifies its whole oracle draft, sixteen concurrent requests verify none;
    outputs stay equal to plain decoding."""
    from deepinfer.speculative.schedule import SpsTable, StepCostFit

    rng = random.Random(8)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 20))] for _ in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    per_chunk = {}
    for group in (1, 16):
        llm = LLM(
            llama, speculative_config={"num_speculative_tokens": 4, "schedule": "hardware"}, max_num_seqs=16
        )
        spec = llm.engine.spec
        assert spec.sps is not None and len(spec.sps.sizes) > 1  # profiled at start
        spec.sps = SpsTable.from_points({1: 100.0, 16: 100.0, 17: 50.0})
        spec.step_cost = StepCostFit(min_weight=float("inf"))
        spec.drafter = _Oracle([p + o for p, o in zip(prompts, plain, strict=True)], 4)
        spec.trials, spec.accepts = [50] * 4, [50] * 4  # a history of full acceptance
        outs = llm.generate(prompts[:group], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain[:group]
        per_chunk[group] = spec.stats.drafted / max(spec.stats.engine_steps, 1) / group
    assert per_chunk[1] > 3 and per_chunk[16] == 0


def test_threshold_schedule_drafts_only_above_the_threshold(llama):
    prompts = repeating_prompts(4, 12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, params, use_tqdm=False)]
    never = LLM(llama, speculative_config={"schedule": "threshold", "confidence_threshold": 1.0})
    assert [o.outputs[0].token_ids for o in never.generate(prompts, params, use_tqdm=False)] == plain
    assert never.engine.spec.stats.drafted == 0  # smoothed confidences are always < 1
    always = LLM(llama, speculative_config={"schedule": "threshold", "confidence_threshold": 0.0})
    assert [o.outputs[0].token_ids for o in always.generate(prompts, params, use_tqdm=False)] == plain
    assert always.engine.spec.stats.drafted > 0


def test_rollback_point_recomputes_only_what_a_closed_group_consumed():
    """A drafted chunk [10, 15) (anchor 10, four drafts); ``accepted_end``: positions before it
    were accepted."""
    from deepinfer.speculative.rollback import rollback_point

    assert rollback_point(10, 15, 12, [1, 2], []) == 12  # ratio 2's open group [12, 12) is empty
    assert rollback_point(10, 15, 13, [1, 2], []) == 12  # group [12, 14) closed: row 12 consumed
    assert rollback_point(10, 13, 13, [2], []) == 13  # group [12, 14) still open: row 12 buffered
    assert rollback_point(10, 15, 11, [4], []) == 10  # group [8, 12) closed: recompute from the start
    assert rollback_point(10, 15, 15, [1, 2, 4], [4]) == 15  # all accepted
    assert rollback_point(10, 15, 13, [4], [4]) == 13  # the overlap's last group [8, 12) was accepted
    assert rollback_point(10, 15, 11, [4], [4]) is None  # the overlap now holds a rejected token


class _WrongUntil(_Oracle):
    """The target's greedy continuation, but wrong at every position before ``until``: a
    request first pauses drafting, then its shadow trials start to hit and it resumes."""

    def __init__(self, sequences: list[list[int]], k: int, until: int) -> None:
        super().__init__(sequences, k)
        self.until = until

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        draft = super().lookup(tokens)
        return wrong_from(draft, 0) if len(tokens) < self.until else draft


def test_adaptive_drafting_pauses_failing_requests_and_resumes_them():
    from deepinfer.speculative.adaptive import AdaptiveDrafting

    state = AdaptiveDrafting()
    state.verified("r", 4, 0)
    assert state.drafting("r")  # one failure is not yet a pattern (min_trials)
    state.verified("r", 4, 0)
    assert not state.drafting("r")
    assert state.shadow("r", 4, 1)  # a first-token hit in a wrong draft does not resume it
    assert state.shadow("r", 4, 1)
    assert not state.drafting("r")
    assert not state.shadow("r", 4, 1, final=False)  # an open trial: one match so far
    assert not state.drafting("r")
    assert state.shadow("r", 4, 2, final=False)  # two matched: resumed at once
    assert state.drafting("r")


class _RightOnce(_Oracle):
    """The target's greedy continuation, right at its first token only: what free-form text
    gives an n-gram drafter (one token of its history repeats, the rest does not)."""

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        return wrong_from(super().lookup(tokens), 1)


@pytest.mark.parametrize("resume_hits", [2, 1])
def test_a_paused_request_needs_more_than_one_matching_token_to_resume(llama, resume_hits):
    """Five-token drafts right at their first token only: the request's average falls below
    0.25 after three verifications, it pauses and stays paused, since its shadow trials never
    match two tokens (3 verified chunks here). ``resume_hits=1`` (the mutation check: the
    first-token rule it replaced) resumes it after every paused step and keeps verifying
    mostly wrong drafts (20 chunks). Greedy outputs equal plain decoding either way."""
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLM(llama).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(llama, speculative_config={"num_speculative_tokens": 5})
    llm.engine.spec.drafter = _RightOnce([prompt + plain], 5)
    llm.engine.spec.adaptive.resume_hits = resume_hits
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain
    stats = llm.engine.spec.stats
    if resume_hits == 2:
        assert stats.verify_steps <= 4, stats
    else:
        assert stats.verify_steps >= 8, stats


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_request_whose_drafts_fail_stops_drafting_until_they_match(llama, adaptive):
    """Drafts wrong for the first 40 positions, right after: with adaptive drafting the
    request pauses after two failed verifications, then resumes and gets drafts accepted;
    without it (the mutation check) it verifies a wrong draft at every early step. Greedy
    outputs equal plain decoding either way."""
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = LLM(llama).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    config = {"num_speculative_tokens": 4, "adaptive": adaptive}
    llm = LLM(llama, speculative_config=config)
    llm.engine.spec.drafter = _WrongUntil([prompt + plain], 4, until=40)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain
    stats = llm.engine.spec.stats
    if adaptive:
        assert stats.accepted > 0 and stats.drafted - stats.accepted <= 3 * 4, stats
    else:
        assert stats.drafted - stats.accepted >= 25, stats


class _WrongFor(_Oracle):
    """The target's greedy continuation, except for sequences starting with ``wrong``:
    their drafts are wrong from the first token."""

    def __init__(self, sequences: list[list[int]], k: int, wrong: list[int]) -> None:
        super().__init__(sequences, k)
        self.wrong = wrong

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        draft = super().lookup(tokens)
        return wrong_from(draft, 0) if list(tokens[: len(self.wrong)]) == self.wrong else draft


@pytest.mark.parametrize("own_rates", [True, False])
def test_lookup_confidences_are_each_requests_own(llama, own_rates, monkeypatch):
    """Two requests in one batch, one whose drafts are always right and one whose drafts
    are always wrong, under the threshold schedule (adaptive pausing off): with per-request
    acceptance rates the wrong one soon verifies nothing while the right one verifies every
    draft. With one pooled rate (the mutation check: the request's own history given no
    weight) both see the same ~50% and verify alike. Outputs equal plain decoding."""
    from deepinfer.speculative import decoder

    if not own_rates:
        monkeypatch.setattr(decoder, "REQUEST_PRIOR_TRIALS", 1e12)
    right, wrong = [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate([right, wrong], params, use_tqdm=False)]
    config = {
        "num_speculative_tokens": 3,
        "schedule": "threshold",
        "confidence_threshold": 0.4,
        "adaptive": False,
    }
    llm = LLM(llama, speculative_config=config)
    llm.engine.spec.drafter = _WrongFor([right + plain[0], wrong + plain[1]], 3, wrong)
    seen = _drafted_per_prompt(llm, monkeypatch)
    outs = llm.generate([right, wrong], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    if own_rates:
        assert seen.get(wrong[0], 0) <= 6 and seen[right[0]] >= 20, seen
    else:
        assert seen[wrong[0]] > 6, seen


def test_the_hardware_schedule_prices_rows_by_the_engines_own_steps(llama):
    """The engine times its decode and verification steps (prefill steps are left out of
    the fit) and, once the fit exists, Algorithm 1 prices a drafted row by it: the same
    confident oracle drafts are verified when the fitted row is cheap and none when a
    step's time is all rows (a draft then pays only if surely accepted)."""
    from deepinfer.speculative.schedule import LinearSps, SpsTable

    prompt = [41, 42, 43, 44, 45, 46]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(llama).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(llama, speculative_config={"num_speculative_tokens": 4, "schedule": "hardware"})
    spec = llm.engine.spec
    spec.drafter = _Oracle([prompt + plain], 4)
    observed: list[int] = []
    orig = spec.step_cost.observe
    spec.step_cost.observe = lambda rows, seconds: (observed.append(rows), orig(rows, seconds))
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert observed and all(1 <= r <= 5 for r in observed)  # one request: its row and drafts
    assert len(observed) == spec.stats.engine_steps + sum(1 for r in observed if r == 1)
    spec.sps = SpsTable.from_points({1: 100.0})  # flat: every draft pays
    for fixed_s, row_s, expect_drafts in ((1.0, 1e-6, True), (1e-6, 1.0, False)):
        spec.step_cost.line = lambda fixed_s=fixed_s, row_s=row_s: LinearSps(fixed_s, row_s)
        spec.stats.__init__()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain
        assert (spec.stats.drafted > 0) == expect_drafts, (row_s, spec.stats)


def _drafted_per_prompt(llm: LLM, monkeypatch) -> dict[int, int]:
    """Drafted tokens verified per request, keyed by its first prompt token."""
    seen: dict[int, int] = {}
    orig = llm.engine.spec._count

    def count(req, drafted, accepted):
        seen[req.prompt_token_ids[0]] = seen.get(req.prompt_token_ids[0], 0) + drafted
        orig(req, drafted, accepted)

    monkeypatch.setattr(llm.engine.spec, "_count", count)
    return seen


@pytest.mark.parametrize("closed_rule", [True, False])
def test_a_closed_batch_verifies_only_drafts_that_can_shorten_it(llama, closed_rule, monkeypatch):
    """``LLM.generate`` with two requests of equal budget, one whose drafts are always right
    and one whose drafts are always wrong: the wrong one pauses on its shadow trials and
    will take every one of its steps, so the right one's drafts cannot end the batch sooner
    and are not verified (nothing is). Given a longer budget, the right one is the last to
    finish and drafts. Alone it drafts. Without the rule (the mutation check: the batch not
    treated as closed) the equal-budget batch verifies the right one's drafts. Outputs
    equal plain decoding throughout."""
    from deepinfer.speculative import decoder

    if not closed_rule:
        monkeypatch.setattr(decoder.SpeculativeDecoder, "_cannot_shorten", lambda self, requests, running: [])
    right, wrong = [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]
    short = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain_llm = LLM(llama)
    plain_short = [o.outputs[0].token_ids for o in plain_llm.generate([right, wrong], short, use_tqdm=False)]
    plain_long = plain_llm.generate([right], long, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(llama, speculative_config={"num_speculative_tokens": 3})
    llm.engine.spec.drafter = _WrongFor([right + plain_long, wrong + plain_short[1]], 3, wrong)
    seen = _drafted_per_prompt(llm, monkeypatch)

    outs = llm.generate([right, wrong], short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_short
    equal_budgets = dict(seen)
    seen.clear()
    outs = llm.generate([right, wrong], [long, short], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain_long, plain_short[1]]
    right_longer = dict(seen)
    seen.clear()
    assert llm.generate([right], short, use_tqdm=False)[0].outputs[0].token_ids == plain_short[0]
    alone = dict(seen)

    assert right_longer.get(right[0], 0) >= 20 and alone.get(right[0], 0) >= 12, (right_longer, alone)
    if closed_rule:
        assert not equal_budgets, equal_budgets
    else:
        assert equal_budgets.get(right[0], 0) >= 12, equal_budgets


def test_requests_outside_llm_generate_are_not_a_closed_batch(llama, monkeypatch):
    """Requests stepped through the engine directly (as the server does) may be joined by
    others at any step: the closed-batch rule does not apply, and the right request of an
    equal-budget pair verifies its drafts."""
    right, wrong = [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama).generate([right, wrong], params, use_tqdm=False)]
    llm = LLM(llama, speculative_config={"num_speculative_tokens": 3})
    llm.engine.spec.drafter = _WrongFor([right + plain[0], wrong + plain[1]], 3, wrong)
    seen = _drafted_per_prompt(llm, monkeypatch)
    reqs = [llm.engine.add_request(f"r{i}", p, params) for i, p in enumerate((right, wrong))]
    while not all(r.finished for r in reqs):
        llm.engine.step()
    assert [r.output_token_ids for r in reqs] == plain
    assert seen.get(right[0], 0) >= 12, seen
