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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.cache.forward_batch import RoutingTrace
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


def _routing(monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every MoE layer's (own, kept) choices [T, k] during the next replayed forwards, in
    layer order: what its gate chose from its inputs, and what it kept after the replay."""
    own: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    original = RoutingTrace.route

    def spy(self, ids: torch.Tensor) -> torch.Tensor:
        out = original(self, ids)
        own.append(ids.detach().clone())
        kept.append(out.detach().clone())
        return out

    monkeypatch.setattr(RoutingTrace, "route", spy)
    return own, kept


def _rows(choices: list[torch.Tensor], n: int) -> torch.Tensor:
    """One forward's per-layer choices as [n, layers, k] int32 rows, as an output carries them."""
    return torch.stack(choices, dim=1)[:n].int()


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)


def test_outputs_carry_the_routing_and_a_replay_reproduces_it(checkpoint, monkeypatch):
    model = load_model(checkpoint, requires_grad=True)
    llm = LLM.from_model(model, enable_return_routed_experts=True, batch_invariant=True)
    n_moe = _moe_layers(model)
    k, experts = model.config.num_experts_per_tok, model.config.n_routed_experts

    @settings(
        max_examples=3,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # a failure is reported unshrunk: shrinking takes minutes
    )
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
            own, kept = _routing(monkeypatch)
            logits = model(torch.tensor([tokens]), routed_experts=[rows], batch_invariant=True).logits
            monkeypatch.undo()
            logp = logits.log_softmax(-1)[0]
            # the gates, on the same inputs, choose the reported rows themselves (so the rows
            # are the rollout's routing), and the replay kept them
            assert torch.equal(_rows(own, len(tokens) - 1), rows)
            assert torch.equal(_rows(kept, len(tokens) - 1), rows)
            got = [
                e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)
            ]
            want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)]
            assert got == want  # exact under batch_invariant

    check()


def test_the_trainer_routes_as_the_rollout_after_its_weights_moved(checkpoint, monkeypatch):
    """The rollout's routing is what its gates chose (shown on the unmoved weights); after the
    router moved, the gates choose otherwise from the same inputs, and the replay keeps the
    rollout's routing."""
    model = load_model(checkpoint, requires_grad=True)
    llm = LLM.from_model(model, enable_return_routed_experts=True)
    prompt = list(range(3, 50))
    out = llm.generate([prompt], _params(1), use_tqdm=False)[0]
    tokens = torch.tensor([prompt + out.outputs[0].token_ids])
    n, rows = tokens.shape[1] - 1, out.routed_experts
    own, kept = _routing(monkeypatch)
    with torch.no_grad():
        model(tokens, routed_experts=[rows])
    rollout = _rows(own, n)
    assert torch.equal(rollout, rows)  # the reported rows are the rollout's own routing
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn_like(p))  # the policy's router moved since the rollout
    own.clear()
    kept.clear()
    with torch.no_grad():
        model(tokens, routed_experts=[rows])
    assert not torch.equal(_rows(own, n), rollout)  # without R3 the routing differs ...
    assert torch.equal(_rows(kept, n), rollout)  # ... with it, it is the rollout's


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
    hits = llm.engine.block_pools[0].hit_blocks
    again = llm.generate([prompt], _params(3), use_tqdm=False)[0]
    assert llm.engine.block_pools[0].hit_blocks > hits
    assert torch.equal(again.routed_experts, alone)
    # mutation check: a hit whose rows are not read back from its blocks leaves them unknown
    monkeypatch.setattr(RoutedExpertsRecorder, "published", lambda self, req, block, h: None)
    llm2 = LLM(str(checkpoint), enable_return_routed_experts=True)
    llm2.generate([prompt], _params(4), use_tqdm=False)
    assert int(llm2.generate([prompt], _params(3), use_tqdm=False)[0].routed_experts.min()) == -1


def test_compiled_steps_record_the_eager_steps_routing(checkpoint):
    """A compiled step (padded to at least two rows) records the routing of its own rows only,
    and records what the eager step records: Inductor on V4; dynamo's eager backend on V4.1,
    whose fp8 scale dtype Inductor's CPU code generator does not take."""
    prompts = [[5, 6, 7, 8, 9][: 2 + i] + [30 + i] * (i + 1) for i in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def run(**options) -> list:
        llm = LLM(str(checkpoint), enable_return_routed_experts=True, max_num_seqs=3, **options)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert (llm.engine.runner.padding is not None) == options["compile"]
        return [(o.outputs[0].token_ids, o.routed_experts.tolist()) for o in outs]

    backend = "eager" if "deepseek_v41" in str(checkpoint) else "inductor"
    torch._dynamo.reset()
    assert run(compile=True, capture_graphs=False, compile_backend=backend) == run(compile=False)


@pytest.mark.parametrize("mutant", [False, True])
def test_asynchronous_steps_record_the_synchronous_steps_routing(v41_ckpt, monkeypatch, mutant):
    """Under asynchronous scheduling a step records on the worker while the next one is
    scheduled, and a block is published while the step writing its last row still runs: its
    rows are kept when they arrive, so a later prefix hit reports them as a synchronous
    engine does (V4.1, whose tiny checkpoint takes prefix hits). Mutation: rows kept only at
    publication leave such hits unknown (-1)."""
    if mutant:
        write = RoutedExpertsRecorder._write

        def without_late_keeps(self, req, start, rows):
            keep, self._keep = self._keep, lambda *args: None
            try:
                write(self, req, start, rows)
            finally:
                self._keep = keep

        monkeypatch.setattr(RoutedExpertsRecorder, "_write", without_late_keeps)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=rng).tolist() for n in (9, 13, 18)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(asynchronous: bool) -> list:
        llm = LLM(
            str(v41_ckpt), enable_return_routed_experts=True, block_size=8, async_scheduling=asynchronous
        )
        assert (llm.engine.async_steps is not None) == asynchronous
        first = llm.generate(prompts, params, use_tqdm=False)
        # the next turn's prompt holds the first reply: its hits cover blocks decode steps filled
        turns = [p + list(o.outputs[0].token_ids) + [7, 8, 9] for p, o in zip(prompts, first, strict=True)]
        second = llm.generate(turns, params, use_tqdm=False)
        assert llm.engine.block_pools[0].hit_blocks > 0
        return [(o.outputs[0].token_ids, o.routed_experts.tolist()) for o in first + second]

    assert (run(True) == run(False)) != mutant


def test_bad_routing_replays_are_named(checkpoint):
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
