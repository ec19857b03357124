"""Model drafters: DSpark on V4.1 and MTP on V4.

- each proposal equals a dense computation of the published math (the DSpark paper, the
  official V4 ``MTPBlock``; tests/support/draft_reference.py) from the weights and config read from the
  checkpoint files, for several requests batched together whose windows wrap around their
  rings; a loader naming bug in the engine fails that check (mutation checks);
- sampled outputs keep the target's distribution (drafts come from their own q);
- DSpark's confidences drive the threshold and hardware schedules; the lagged production
  schedule sizes a step from confidences two plans old;
- a checkpoint without its draft layers loads and serves, and asks for them clearly.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from chi_square import conditional_p_value, exact_next_token
from draft_reference import dspark_proposal, mtp_proposal
from dspark_heads import observed_proposals
from mutations import accept_every_draft, wrong_from
from reference_mutations import swap_on_load
from v41_reference import read_checkpoint

from deepinfer import LLM, SamplingParams
from deepinfer.models.loading import load_model
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.drafter import Draft, DraftRequest
from deepinfer.speculative.dspark import DSparkDrafter
from deepinfer.speculative.mtp import MtpDrafter
from deepinfer.speculative.rollback import Rollback
from deepinfer.speculative.schedule import SpsTable, capacity_from, threshold_schedule
from deepinfer.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dspark"), arch="deepseek_v41")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), arch="deepseek_v4")


@pytest.fixture(scope="module")
def v41_ref(v41):
    """The weights and config as the reference reads them from the files (no deepinfer code)."""
    return read_checkpoint(v41)


@pytest.fixture(scope="module")
def v4_ref(v4):
    return read_checkpoint(v4)


def _dspark_proposals(model):
    """DSpark's proposals for three sequences batched together, and each alone, after two
    steps' worth of accepted rows each (``dspark_heads.observed_proposals``):
    [(features, ask, batched draft, alone draft)], and the drafter."""
    cfg = model.config
    drafter = DSparkDrafter(
        model.draft_model("dspark"), num_slots=3, num_speculative_tokens=cfg.dspark_block_size
    )
    width = cfg.hidden_size * len(cfg.dspark_target_layer_ids)
    return observed_proposals(drafter, width, seed=0), drafter


def _confidences_close(got: list[float], want: list[float]) -> bool:
    return torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_dspark_proposals_equal_the_reference_computation(v41, v41_ref):
    """Each proposal equals ``draft_reference.dspark_proposal`` on the checkpoint's weights."""
    model = load_model(v41, fake_quant=True)
    k = model.config.dspark_block_size
    rows, drafter = _dspark_proposals(model)
    for feats, ask, draft, alone in rows:
        tokens, conf = dspark_proposal(v41_ref, feats, ask.anchor_token, k, fake_quant=True)
        assert draft.tokens == tokens == alone.tokens
        assert draft.anchor_pos == ask.anchor_pos and draft.q is None
        assert _confidences_close(draft.confidences, conf) and _confidences_close(alone.confidences, conf)
    # a new owner of a slot starts from an empty ring: only its own rows are read
    drafter.claim(0, "other")
    assert not bool((drafter.ring.pos[0] >= 0).any())


@torch.inference_mode()
def test_dspark_reference_check_fails_on_a_stage_naming_bug(v41, v41_ref, monkeypatch):
    """Mutation check of the test above: an engine loader that swaps stages 0 and 1's
    K=V projections (same shape) makes every proposal's confidences leave the tolerance."""
    swap_on_load(monkeypatch, [("mtp.0.attn.wkv.weight", "mtp.1.attn.wkv.weight")])
    model = load_model(v41, fake_quant=True)
    k = model.config.dspark_block_size
    rows, _ = _dspark_proposals(model)
    for feats, ask, draft, _ in rows:
        tokens, conf = dspark_proposal(v41_ref, feats, ask.anchor_token, k, fake_quant=True)
        assert not _confidences_close(draft.confidences, conf), (draft.confidences, conf)


def _mtp_proposals(model, k: int):
    """MTP-k proposals for two sequences batched, after two steps of accepted rows each
    (19 rows wrap the window of 8): [(streams [P, n, d], tokens 0..P, draft)]."""
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    lengths = {1: 19, 0: 4}
    streams = {s: torch.randn(p, cfg.hc_mult, cfg.hidden_size, generator=gen) for s, p in lengths.items()}
    tokens = {s: torch.randint(3, 250, (p + 1,), generator=gen).tolist() for s, p in lengths.items()}
    drafter = MtpDrafter(model.draft_model("mtp"), num_slots=2, num_speculative_tokens=k)
    for s, p in lengths.items():
        drafter.claim(s, f"r{s}")
        for lo, hi in ((0, p - 3), (p - 3, p)):
            drafter.observe(
                [s] * (hi - lo),
                list(range(lo, hi)),
                streams[s][lo:hi].flatten(1),
                tokens[s][lo + 1 : hi + 1],
            )
    asks = [DraftRequest(s, p, tokens[s][p], GREEDY, None) for s, p in lengths.items()]
    rows = [(streams[a.slot], tokens[a.slot], d) for a, d in zip(asks, drafter.propose(asks), strict=True)]
    # a sequence whose newest accepted row is not P - 1 gets no draft
    late = drafter.propose([DraftRequest(1, lengths[1] + 2, 5, GREEDY, None)])[0]
    return rows, late


@torch.inference_mode()
def test_mtp_proposals_equal_the_reference_computation(v4, v4_ref):
    """Each proposal equals ``draft_reference.mtp_proposal`` on the checkpoint's weights."""
    model = load_model(v4)
    for k in (1, 3):
        rows, late = _mtp_proposals(model, k)
        for streams, tokens, draft in rows:
            assert draft.tokens == mtp_proposal(v4_ref, streams, tokens, k)
        assert late.tokens == []


@torch.inference_mode()
def test_mtp_reference_check_fails_on_a_naming_bug(v4, v4_ref, monkeypatch):
    """Mutation check of the test above: an engine loader that swaps the MTP layer's
    embedding and stream projections (``e_proj``/``h_proj``, same shape) changes the drafts."""
    swap_on_load(monkeypatch, [("mtp.0.e_proj.weight", "mtp.0.h_proj.weight")])
    model = load_model(v4)
    rows, _ = _mtp_proposals(model, 3)
    assert any(draft.tokens != mtp_proposal(v4_ref, streams, tokens, 3) for streams, tokens, draft in rows)


def _drafted_positions_p_value(path, method: str, broken_verifier: bool, monkeypatch):
    """Many seeds of one prompt at temperature 0.3: the tokens at positions 1 and 2 (verified
    drafts, their residual resamples or bonus tokens), given the tokens before them, follow
    the target's exact conditional distribution (one-sample chi-square, bins expected >= 5)."""
    n, temperature = 600, 0.3
    prompt = [7, 9, 11, 13] * 3
    if broken_verifier:  # mutation: every draft accepted
        accept_every_draft(monkeypatch)
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)
    ]
    spec = LLM(path, max_num_seqs=64, speculative_config={"method": method, "num_speculative_tokens": 2})
    outs = [o.outputs[0].token_ids for o in spec.generate([prompt] * n, params, use_tqdm=False)]
    p, used = conditional_p_value(outs, (1, 2), exact_next_token(path, prompt, temperature))
    assert used >= n // 3, f"only {used} samples fell in groups large enough to test"
    return p, spec.engine.spec.stats


@pytest.mark.parametrize(("arch", "method"), [("deepseek_v41", "dspark"), ("deepseek_v4", "mtp")])
def test_sampled_tokens_keep_the_target_distribution(arch, method, v41, v4, monkeypatch):
    p, stats = _drafted_positions_p_value(v41 if arch == "deepseek_v41" else v4, method, False, monkeypatch)
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted  # both outcomes happened
    assert p > 1e-3, p


@pytest.mark.parametrize(("arch", "method"), [("deepseek_v41", "dspark"), ("deepseek_v4", "mtp")])
def test_a_verifier_accepting_everything_fails(arch, method, v41, v4, monkeypatch):
    """Mutation check of the test above."""
    p, _ = _drafted_positions_p_value(v41 if arch == "deepseek_v41" else v4, method, True, monkeypatch)
    assert p < 1e-6, p


def test_dspark_greedy_outputs_and_metrics_under_chunking_preemption_and_prefix_hits(v41):
    """Greedy DSpark equals plain decoding while prompts share prefixes (cache hits leave
    the drafter's ring without those rows), prefill is chunked and a small cache preempts."""
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    prompts = [base + [30 + i] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(v41).generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        v41,
        speculative_config={"method": "dspark", "num_speculative_tokens": 4},
        max_num_batched_tokens=24,
        num_cache_blocks=9,
        max_num_seqs=4,
    )
    preempted = []
    preempt = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert preempted  # the small cache forced recomputation
    stats = llm.engine.spec.stats
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.drafted > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.accepted
    assert any(o.num_cached_tokens for o in outs)
    assert not llm.engine.spec.drafts  # finished requests leave no drafts behind


def test_dspark_confidences_drive_the_threshold_schedule(v41):
    prompts = [[3, 4, 5, 6, 7], [40, 41, 42]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(v41).generate(prompts, params, use_tqdm=False)]
    for threshold in (0.0, 0.5, 1.0):
        llm = LLM(
            v41,
            speculative_config={
                "method": "dspark",
                "schedule": "threshold",
                "confidence_threshold": threshold,
                "adaptive": False,  # the random drafts always fail: no pausing, test the schedule
            },
        )
        engine, spec = llm.engine, llm.engine.spec
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        checked = 0
        while engine.has_unfinished():
            engine.step()
            live = [r for r in reqs if not r.finished and r.request_id in spec.drafts]
            spec.plan(live)
            for r in live:
                conf = spec.drafts[r.request_id].confidences
                assert spec.confidences(r) == conf  # the head's, not acceptance rates
                assert spec.allowed[r.request_id] == threshold_schedule([conf], threshold)[0]
                checked += 1
        assert checked > 0
        assert [r.output_token_ids for r in reqs] == plain
        if threshold == 1.0:
            assert spec.stats.drafted == 0  # a sigmoid never reaches 1
        if threshold == 0.0:
            assert spec.stats.drafted > 0


class _FakeDrafter:
    num_draft_tokens = 3
    window = 4


def test_lagged_schedule_sizes_a_step_from_confidences_two_plans_old(v41):
    sps = SpsTable.from_points({1: 100.0, 3: 90.0, 5: 80.0, 8: 80.0, 9: 10.0})
    config = SpeculativeConfig(method="dspark", schedule="hardware")
    spec = SpeculativeDecoder(config, _FakeDrafter(), 64, Rollback([], [], slots=None), sps, lagged=True)

    class Req:
        def __init__(self, rid):
            self.request_id, self.num_tokens = rid, 10

    reqs = [Req("a"), Req("b")]
    low, high = [0.01, 0.01, 0.01], [0.99, 0.98, 0.97]

    def plan(conf):
        for r in reqs:
            spec.drafts[r.request_id] = Draft(9, [1, 2, 3], None, conf)
        spec.plan(reqs)
        return [spec.allowed[r.request_id] for r in reqs]

    assert plan(low) == [3, 3]  # no history yet: every draft fits
    assert plan(high) == [3, 3]
    assert capacity_from([low, low], sps) == 0
    assert plan(high) == [0, 0]  # capacity from `low` (two plans back), ranked by `high`
    assert capacity_from([high, high], sps) > 0
    got = plan(low)  # capacity from the first `high`: top-K of the current (low) survivals
    assert sum(got) == capacity_from([high, high], sps) == 6
    # in the engine: async_scheduling=True selects the lagged form; outputs stay exact
    prompts = [[3, 4, 5, 6, 7], [40, 41, 42]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(v41).generate(prompts, params, use_tqdm=False)]
    llm = LLM(v41, speculative_config={"method": "dspark", "schedule": "hardware"}, async_scheduling=True)
    assert llm.engine.spec.lagged and llm.engine.async_steps is None  # drafting steps run in order
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain


def test_checkpoint_without_draft_layers_loads_and_asks_for_them(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4")
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        state = {k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}
        save_file(state, f)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
        index.write_text(json.dumps(data))
    model = load_model(path)
    assert len(model.mtp) == 0
    out = LLM(path).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="with its MTP layer"):
        LLM(path, speculative_config={"method": "mtp"})


def test_dspark_drafts_its_block_and_refuses_bad_configs(v41):
    llm = LLM(v41, speculative_config={"method": "dspark"})
    assert llm.engine.spec.num_draft_tokens == llm.engine.model.config.dspark_block_size == 4
    with pytest.raises(ValueError, match="exceeds the DSpark block"):
        LLM(v41, speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match="ced_prefill"):
        LLM(v41, speculative_config={"method": "dspark"}, ced_prefill=True)


def test_draft_sampling_uses_the_requests_filters():
    """Non-greedy drafts come from the request's filtered distribution (top-k 1 = argmax)."""
    from deepinfer.speculative.drafter import sample_drafts

    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    reqs = [
        DraftRequest(
            0, 5, 1, SamplingParams(temperature=1.0, top_k=1, seed=0), torch.Generator().manual_seed(0)
        ),
        DraftRequest(1, 5, 1, GREEDY, None),
    ]
    tokens, qs = sample_drafts(logits, reqs)
    assert tokens.tolist() == [1, 3] and qs[1] is None
    torch.testing.assert_close(qs[0], F.one_hot(torch.tensor(1), 4).float())


@pytest.mark.parametrize(("arch", "method"), [("deepseek_v41", "dspark"), ("deepseek_v4", "mtp")])
def test_partly_accepted_drafts_keep_greedy_outputs(arch, method, v41, v4):
    """The random tiny drafters are almost never right, so their own drafts test rejection
    only. Here each proposal (made by the drafter, so its rings and features advance as
    usual) is replaced by the target's greedy continuation, wrong from a random depth on:
    drafts are accepted in part, and the accepted rows, the rollback of compressor state
    and the drafter's rings must leave greedy outputs equal to plain decoding.

    Without QAT rounding (``fake_quant=False``): rounded caches turn the last-bit differences
    of a drafted chunk's matrix shapes into whole grid steps that compound over a long greedy
    run (measured: a divergence after 36 tokens at a 4e-2 top-2 gap). Exact equality under
    rounding needs a batch-invariant mode."""
    path = v41 if arch == "deepseek_v41" else v4
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [
        o.outputs[0].token_ids for o in LLM(path, fake_quant=False).generate(prompts, params, use_tqdm=False)
    ]
    full = {tuple(p): p + o for p, o in zip(prompts, plain, strict=True)}
    llm = LLM(
        path,
        speculative_config={"method": method},
        max_num_batched_tokens=48,
        max_num_seqs=4,
        fake_quant=False,
    )
    engine = llm.engine
    drafter = engine.spec.drafter
    propose = drafter.propose

    def diverging(asks):
        drafts = propose(asks)
        for ask, draft in zip(asks, drafts, strict=True):
            req = next(r for r in engine.requests.values() if r.slot == ask.slot and not r.finished)
            truth = full[tuple(req.prompt_token_ids)][ask.anchor_pos + 1 :]
            k = min(drafter.num_draft_tokens, len(truth))
            draft.tokens = wrong_from(truth[:k], rng.randrange(k + 1))
            draft.confidences = draft.confidences[:k] + [0.5] * (k - len(draft.confidences[:k]))
            draft.q = None  # greedy verification
        return drafts

    drafter.propose = diverging
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = engine.spec.stats
    assert 0 < stats.accepted < stats.drafted and stats.accepted >= stats.drafted // 4, stats
