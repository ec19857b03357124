"""``enable_return_routed_experts`` and routing replay (R3) on V4 and V4.1: every output carries
the experts each token it read was routed to, per MoE layer (prefix-cache hits included); a
training forward given them routes every token exactly so (the gates' choices are the
rollout's, also after the weights moved) and then has the rollout's logprobs exactly (under
``batch_invariant``). Mutation
checks: a replay of other experts changes the logits, and a hit whose rows were not read back
from its blocks is caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.routed_experts import RoutedExpertsRecorder
from deepinfer.models.layers.moe import Gate
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint

ARCHS = ["deepseek_v4", "deepseek_v41"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, seed=9)


def _moe_layers(model) -> int:
    """The backbone's MoE layers (the draft layers' are not part of a step's routing)."""
    return sum(1 for m in model.layers.modules() if isinstance(m, Gate))


def _gate_choices(model, monkeypatch) -> list[torch.Tensor]:
    """Every gate's kept choice [T, k] during the next forwards, in layer order."""
    seen: list[torch.Tensor] = []
    original = Gate.forward

    def spy(self, x, input_ids, routing=None):
        weights, ids = original(self, x, input_ids, routing)
        seen.append(ids.detach().clone())
        return weights, ids

    monkeypatch.setattr(Gate, "forward", spy)
    return seen


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)


def test_outputs_carry_the_routing_and_a_replay_reproduces_it(checkpoint, monkeypatch):
    model = load_model(checkpoint, requires_grad=True)
    llm = LLM.from_model(model, enable_return_routed_experts=True, batch_invariant=True)
    n_moe = _moe_layers(model)
    k, experts = model.config.num_experts_per_tok, model.config.n_routed_experts

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16))
    def check(seed):
        gen = torch.Generator().manual_seed(seed)
        prompts = [
            torch.randint(2, 250, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 60, (3,), generator=gen)
        ]
        for prompt, out in zip(prompts, llm.generate(prompts, _params(seed), use_tqdm=False), strict=True):
            tokens = prompt + out.outputs[0].token_ids
            rows = out.routed_experts
            assert rows.shape == (len(tokens) - 1, n_moe, k) and rows.dtype == torch.int32
            assert int(rows.min()) >= 0 and int(rows.max()) < experts
            seen = _gate_choices(model, monkeypatch)
            logits = model(torch.tensor([tokens]), routed_experts=[rows], batch_invariant=True).logits
            logp = logits.log_softmax(-1)[0]
            replayed = torch.stack(seen, dim=1)[: len(tokens) - 1]
            assert torch.equal(replayed.int(), rows)  # every gate kept the rollout's choice
            monkeypatch.undo()
            got = [
                e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)
            ]
            want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)]
            assert got == want  # exact under batch_invariant

    check()


def test_the_trainer_routes_as_the_rollout_after_its_weights_moved(checkpoint, monkeypatch):
    model = load_model(checkpoint, requires_grad=True)
    llm = LLM.from_model(model, enable_return_routed_experts=True)
    prompt = list(range(3, 50))
    out = llm.generate([prompt], _params(1), use_tqdm=False)[0]
    tokens = torch.tensor([prompt + out.outputs[0].token_ids])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn_like(p))  # the policy's router moved since the rollout
    seen = _gate_choices(model, monkeypatch)
    model(tokens)
    own = torch.stack(seen, dim=1)[: tokens.shape[1] - 1]
    seen.clear()
    model(tokens, routed_experts=[out.routed_experts])
    replayed = torch.stack(seen, dim=1)[: tokens.shape[1] - 1]
    assert not torch.equal(own.int(), out.routed_experts)  # without R3 the routing differs ...
    assert torch.equal(replayed.int(), out.routed_experts)  # ... with it, it is the rollout's


def test_a_replay_of_other_experts_changes_the_logits(checkpoint):
    """Mutation check: the replay is what the gates use."""
    model = load_model(checkpoint)
    llm = LLM.from_model(model, enable_return_routed_experts=True)
    prompt = list(range(3, 40))
    out = llm.generate([prompt], _params(2), use_tqdm=False)[0]
    tokens = torch.tensor([prompt + out.outputs[0].token_ids])
    rows = out.routed_experts
    with torch.no_grad():
        same = model(tokens, routed_experts=[rows]).logits
        other = model(tokens, routed_experts=[(rows + 1) % model.config.n_routed_experts]).logits
    assert not torch.equal(same, other)


def test_prefix_cache_hits_report_their_blocks_routing(checkpoint, monkeypatch):
    prompt = [3 + i % 200 for i in range(300)]  # past V4's 128-token cache blocks
    fresh = LLM(str(checkpoint), enable_return_routed_experts=True)
    alone = fresh.generate([prompt], _params(3), use_tqdm=False)[0].routed_experts
    llm = LLM(str(checkpoint), enable_return_routed_experts=True)
    llm.generate([prompt], _params(4), use_tqdm=False)
    hits = llm.engine.pool.hit_blocks
    again = llm.generate([prompt], _params(3), use_tqdm=False)[0]
    assert llm.engine.pool.hit_blocks > hits
    assert torch.equal(again.routed_experts, alone)
    # mutation check: a hit whose rows are not read back from its blocks leaves them unknown
    monkeypatch.setattr(RoutedExpertsRecorder, "published", lambda self, req, block, h: None)
    llm2 = LLM(str(checkpoint), enable_return_routed_experts=True)
    llm2.generate([prompt], _params(4), use_tqdm=False)
    assert int(llm2.generate([prompt], _params(3), use_tqdm=False)[0].routed_experts.min()) == -1


def test_bad_routing_options_and_replays_are_named(checkpoint):
    with pytest.raises(ValueError, match="compile"):
        LLM(str(checkpoint), enable_return_routed_experts=True, compile=True)
    model = load_model(checkpoint)
    tokens = torch.tensor([[5, 6, 7, 8]])
    n_moe = _moe_layers(model)
    k = model.config.num_experts_per_tok
    with pytest.raises(ValueError, match="routed_experts"):
        model(tokens, routed_experts=[torch.zeros(9, n_moe, k, dtype=torch.int32)])  # past the row
    with pytest.raises(ValueError, match="MoE layers"):
        model(tokens, routed_experts=[torch.zeros(4, n_moe + 1, k, dtype=torch.int32)])
    with pytest.raises(ValueError, match="routed_experts"):
        model(tokens, routed_experts=[torch.zeros(4, n_moe, k + 1, dtype=torch.int32)])
