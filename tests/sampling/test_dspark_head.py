"""A separately trained DSpark head on a Llama-family target (``speculative_config.model``).

- each proposal equals a dense computation written from the files alone
  (tests/support/dspark_head_reference.py), batched and alone, with windows that wrap their
  rings; a head whose two layers' query projections are swapped fails that check;
- greedy outputs equal plain decoding under random workloads (batching, chunked prefill, a
  small cache that preempts, prefix hits), with the one-call CPU decode and the layer loop
  (whose features, and so drafts, are the same);
- sampled outputs keep the target's distribution with a briefly trained head, drafting from the
  whole vocabulary or a draft vocabulary (mutation: a verifier accepting everything);
- the per-position acceptance and calibration figures count what happened;
- bad heads and configurations are clear errors.
Training (tests/sampling/test_drafter_training.py) and the trained SmolLM2 head
(test_trained_smollm2_head.py) have their own files.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from chi_square import conditional_p_value, exact_next_token
from dspark_head_reference import HeadReference
from dspark_heads import TINY_HEAD_SHAPE, observed_proposals, random_head
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutations import accept_every_draft
from safetensors.torch import load_file, save_file

from deepinfer import LLM, CheckpointError, SamplingParams
from deepinfer.drafter_training.recipe import train_drafter
from deepinfer.drafter_training.train import TrainOptions
from deepinfer.models.dspark_head import load_head
from deepinfer.models.loading import load_model
from deepinfer.speculative.dspark import DSparkDrafter
from deepinfer.speculative.stats import SpecStats
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("head_target"), arch="llama")


@pytest.fixture(scope="module", params=[0, 200], ids=["full_vocab", "draft_vocab"])
def head_dir(target, tmp_path_factory, request):
    """A random head drafting from the whole vocabulary, and one from 200 random tokens."""
    path = tmp_path_factory.mktemp("head")
    random_head(
        path, json.loads((target / "config.json").read_text()), seed=0, draft_vocab_size=request.param
    )
    return path


def _proposals(target, head_path):
    model = load_model(target)
    drafter = DSparkDrafter(model.draft_head(load_head(head_path)), num_slots=3, num_speculative_tokens=None)
    return observed_proposals(drafter, model.config.hidden_size * len(drafter.feature_layers), seed=1)


def _close(got: list[float], want: list[float]) -> bool:
    return torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_proposals_equal_the_reference_computation(target, head_dir):
    ref = HeadReference(head_dir, target)
    for feats, ask, draft, alone in _proposals(target, head_dir):
        tokens, conf = ref.propose(feats, ask.anchor_token, ask.anchor_pos)
        assert draft.tokens == alone.tokens == tokens
        assert _close(draft.confidences, conf) and _close(alone.confidences, conf)


@torch.inference_mode()
def test_the_reference_check_fails_on_swapped_layers(target, head_dir, tmp_path):
    """Mutation check of the test above: the two layers' query projections swapped in the file."""
    shutil.copy(head_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(head_dir / "model.safetensors"))
    a, b = "layers.0.q_proj.weight", "layers.1.q_proj.weight"
    state[a], state[b] = state[b], state[a]
    save_file(state, str(tmp_path / "model.safetensors"))
    ref = HeadReference(head_dir, target)
    for feats, ask, draft, _ in _proposals(target, tmp_path):
        tokens, conf = ref.propose(feats, ask.anchor_token, ask.anchor_pos)
        assert draft.tokens != tokens or not _close(draft.confidences, conf)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 6),
    budget=st.sampled_from([16, 40, 256]),
    blocks=st.sampled_from([None, 20]),
    k=st.sampled_from([None, 2]),
)
def test_greedy_outputs_equal_plain_decoding(target, head_dir, seed, n, budget, blocks, k):
    """Random prompts (some sharing a prefix: cache hits leave the ring without those rows)
    with chunked prefill and, with 20 blocks, preemption."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, 258) for _ in range(rng.randrange(0, 20))]
    prompts = [shared + [rng.randrange(2, 258) for _ in range(rng.randrange(1, 24))] for _ in range(n)]
    max_tokens = rng.randrange(4, 30)
    options = {"max_num_batched_tokens": budget, "block_size": 4, "max_num_seqs": 4}
    if blocks is not None:
        options["num_cache_blocks"] = blocks
    plain = _greedy(LLM(target, **options), prompts, max_tokens)
    spec = {"method": "dspark", "model": str(head_dir), "adaptive": False, "num_speculative_tokens": k}
    llm = LLM(target, speculative_config=spec, **options)
    assert _greedy(llm, prompts, max_tokens) == plain
    assert llm.engine.spec.stats.verify_steps > 0
    assert llm.engine.block_pools[0].num_free == llm.engine.num_blocks


def test_the_one_call_decode_hands_the_head_the_layer_loops_features(target, head_dir):
    """The one-call CPU stack, run in segments between the head's layers, gives the same
    features as the layer loop: the same drafts, acceptances and rings."""
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], list(range(40, 70))]
    spec = {"method": "dspark", "model": str(head_dir), "adaptive": False}
    runs = []
    for one_call in (True, False):
        llm = LLM(target, speculative_config=spec, max_num_seqs=4, enable_prefix_caching=False)
        forward = llm.engine.runner.forward
        assert getattr(forward, "stack", None) is not None
        if not one_call:
            forward.stack = None
        outs = _greedy(llm, prompts, 20)
        s = llm.engine.spec.stats
        runs.append((outs, s.drafted, s.accepted, llm.engine.spec.drafter.ring.kv.clone()))
    (a, da, aa, ring_a), (b, db, ab, ring_b) = runs
    assert a == b and (da, aa) == (db, ab)
    torch.testing.assert_close(ring_a, ring_b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=[0, 128], ids=["full_vocab", "draft_vocab"])
def trained_head_dir(target, tmp_path_factory, request):
    """A head the recipe trained briefly on the target's own replies (drafts the target
    accepts often), drafting from the whole vocabulary or from its replies' 128 most frequent
    tokens."""
    out = tmp_path_factory.mktemp("trained_head")
    options = TrainOptions(steps=60, lr=3e-3, warmup=5, sequences_per_step=4, anchors_per_sequence=8)
    shape = {**TINY_HEAD_SHAPE, "block_size": 4, "draft_vocab_size": request.param}
    train_drafter(target, out, prompts=24, max_tokens=24, options=options, head_shape=shape)
    return out


def _sampled_p_value(target, head_dir, broken: bool, monkeypatch) -> tuple[float, SpecStats]:
    n, temperature, prompt = 600, 0.7, [7, 9, 11, 13] * 3
    if broken:  # mutation: every draft accepted
        accept_every_draft(monkeypatch)
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)
    ]
    spec = {"method": "dspark", "model": str(head_dir), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(target, max_num_seqs=64, speculative_config=spec)
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    p, used = conditional_p_value(outs, (1, 2), exact_next_token(target, prompt, temperature))
    assert used >= n // 3, f"only {used} samples fell in groups large enough to test"
    return p, llm.engine.spec.stats


def test_sampled_tokens_keep_the_target_distribution(target, trained_head_dir, monkeypatch):
    p, stats = _sampled_p_value(target, trained_head_dir, False, monkeypatch)
    assert 0 < stats.accepted < stats.drafted
    assert p > 1e-3, p


def test_a_verifier_accepting_everything_fails(target, trained_head_dir, monkeypatch):
    p, _ = _sampled_p_value(target, trained_head_dir, True, monkeypatch)
    assert p < 1e-6, p


def test_position_figures_count_what_was_verified(target, head_dir):
    """Acceptance by position and calibration from the engine equal a recount of its own
    verified chunks; ``get_metrics`` reports the same counters."""
    spec = {"method": "dspark", "model": str(head_dir), "adaptive": False}
    llm = LLM(target, speculative_config=spec, max_num_seqs=4)
    seen: list[tuple[int, int, list[float] | None]] = []
    record = llm.engine.spec.stats.record_positions

    def spy(drafted, accepted, confidences):
        seen.append((drafted, accepted, confidences))
        record(drafted, accepted, confidences)

    llm.engine.spec.stats.record_positions = spy
    _greedy(llm, [[5, 6, 7, 8, 9] * 3, [11, 12, 13], list(range(40, 60))], 24)
    s = llm.engine.spec.stats
    assert seen and all(c is not None and len(c) >= d for d, _, c in seen)
    k = max(d for d, _, _ in seen)
    for j in range(k):
        drafted = [(d, a, c) for d, a, c in seen if d > j]
        assert s.position_drafted[j] == len(drafted)
        assert s.position_survived[j] == sum(a > j for _, a, _ in drafted)
        tested = [a for _, a, _ in drafted if a >= j]
        rate = sum(a > j for a in tested) / len(tested) if tested else 0.0
        assert s.acceptance_by_position[j] == pytest.approx(rate)
        predicted = sum(float(torch.tensor(c[: j + 1]).prod()) for _, _, c in drafted) / len(drafted)
        assert s.calibration[j][0] == pytest.approx(predicted, rel=1e-6)
        assert s.calibration[j][1] == pytest.approx(s.position_survived[j] / len(drafted))
    metrics = {(m.name, m.labels.get("position")): m.value for m in llm.get_metrics()}
    assert metrics[("deepinfer:spec_decode_num_accepted_tokens_per_pos", "0")] == s.position_survived[0]
    assert metrics[("deepinfer:spec_decode_num_drafts_per_pos", "0")] == s.position_drafted[0]
    assert metrics[("deepinfer:spec_decode_num_verified_chunks", None)] == s.verify_steps


def _shadow_proposals(target, head_dir) -> tuple[int, int]:
    """(proposals nobody verified, tokens decoded without verification) of greedy requests
    drafted by a random head, whose drafts fail so adaptive drafting pauses them; outputs
    equal plain decoding's."""
    prompts, max_tokens = [[5, 6, 7, 8, 9] * 3, list(range(40, 60))], 48
    plain = _greedy(LLM(target, max_num_seqs=1), prompts, max_tokens)
    llm = LLM(target, max_num_seqs=1, speculative_config={"method": "dspark", "model": str(head_dir)})
    asked: list[int] = []
    propose = llm.engine.spec.drafter.propose
    llm.engine.spec.drafter.propose = lambda requests: asked.append(len(requests)) or propose(requests)
    assert _greedy(llm, prompts, max_tokens) == plain
    stats = llm.engine.spec.stats
    # each verified step used one proposal; the rest were proposed for shadow trials
    unverified_tokens = len(prompts) * max_tokens - stats.accepted - stats.verify_steps
    return sum(asked) - stats.verify_steps, unverified_tokens


def test_unverified_requests_ask_the_head_only_every_few_steps(target, head_dir):
    """A paused request keeps proposing for shadow trials, but a model drafter's proposal is
    a forward: it asks one only every ``SHADOW_STRIDE``-th step."""
    from deepinfer.speculative.decoder import SHADOW_STRIDE

    shadow, unverified = _shadow_proposals(target, head_dir)
    assert unverified > 48  # the random head's requests did pause
    assert shadow <= unverified / SHADOW_STRIDE + 4, (shadow, unverified)


def test_a_head_asked_every_step_fails_the_count(target, head_dir, monkeypatch):
    from deepinfer.speculative import decoder

    stride = decoder.SHADOW_STRIDE
    monkeypatch.setattr(decoder, "SHADOW_STRIDE", 1)
    shadow, unverified = _shadow_proposals(target, head_dir)
    assert shadow > unverified / stride + 4, (shadow, unverified)


def test_bad_heads_and_configurations_are_clear_errors(target, head_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ValueError, match="speculative_config.model names a DSpark head"):
        LLM(target, speculative_config={"method": "ngram", "model": str(head_dir)})
    with pytest.raises(CheckpointError, match="is not a DSpark head"):
        LLM(target, speculative_config={"method": "dspark", "model": str(tmp_path)})
    raw = json.loads((head_dir / "config.json").read_text())
    for field, value, message in [
        ("target_layer_ids", [1, 3], r"reads layers \[3\]"),
        ("target_layer_ids", [2, 1], "must increase"),
        ("num_heads", 3, "multiple of num_kv_heads"),
        ("block_size", 0, "block_size must be an integer >= 1"),
        ("draft_vocab_size", 10**6, r"draft_vocab_size must be in \[0, vocab_size\]"),
    ]:
        bad = tmp_path / f"bad_{field}_{value}"
        bad.mkdir()
        shutil.copy(head_dir / "model.safetensors", bad / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(CheckpointError, match=message):
            LLM(target, speculative_config={"method": "dspark", "model": str(bad)})
    random_head(tmp_path / "wide", {"hidden_size": 128, "vocab_size": raw["vocab_size"]}, seed=1)
    with pytest.raises(CheckpointError, match="trained for hidden_size=128"):
        LLM(target, speculative_config={"method": "dspark", "model": str(tmp_path / "wide")})
    with pytest.raises(CheckpointError, match="train-drafter smollm2-135m"):
        LLM(target, speculative_config={"method": "dspark", "model": "smollm2-135m-dspark"})
    v41 = make_tiny_checkpoint(tmp_path / "v41", arch="deepseek_v41")
    with pytest.raises(ValueError, match="drafts with the layers of its own checkpoint"):
        LLM(v41, speculative_config={"method": "dspark", "model": str(head_dir)})


def test_the_server_reports_the_position_figures(target, head_dir):
    """``/metrics`` carries the per-position counters, equal to the engine's own."""
    import httpx
    from live_server import LiveServer

    from deepinfer.server.app import build_app

    spec = {"method": "dspark", "model": str(head_dir), "adaptive": False}
    llm = LLM(target, speculative_config=spec, max_num_seqs=4)
    live = LiveServer(build_app(llm, "tiny"))
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9] * 3, "max_tokens": 16, "temperature": 0.0}
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(f"{live.url}/metrics").text
    finally:
        live.stop()
    s = llm.engine.spec.stats
    assert s.verify_steps > 0
    for name, value in [
        (
            'deepinfer:spec_decode_num_drafts_per_pos_total{model_name="tiny",position="0"}',
            s.position_drafted[0],
        ),
        (
            'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}',
            s.position_survived[0],
        ),
        ('deepinfer:spec_decode_num_verified_chunks_total{model_name="tiny"}', s.verify_steps),
    ]:
        line = next(row for row in text.splitlines() if row.startswith(name + " "))
        assert float(line.split()[-1]) == value
    assert 'deepinfer:spec_decode_predicted_survival_total{model_name="tiny",position="0"}' in text
