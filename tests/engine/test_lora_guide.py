"""The LoRA guide's promises (docs/guide/lora.md) that other tests leave out: the PEFT options
refused by name, ``alpha_pattern``, ``enable_lora``'s refusals, ``LLM.stream(lora_request=)``,
the ``max_loras`` limit on running adapters, least-recently-used eviction of the adapters
requests bring, and base-model steps computed exactly as without ``enable_lora``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_adapters import hf_llama, make_adapter

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

PROMPT = [5, 77, 12, 140, 3, 61]
EAGER = {"compile": False}


def _greedy(max_tokens: int = 5, logprobs: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)


def _logprob_gap(reference: torch.nn.Module, prompt: list[int], out) -> float:
    """The largest gap between ``out``'s logprobs of its tokens and the reference's."""
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    ours = torch.tensor([out.outputs[0].logprobs[k][t].logprob for k, t in enumerate(tokens)])
    theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (ours - theirs).abs().max().item()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tiny Llama, its transformers twin, and four PEFT adapters that change its tokens."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=4)
    base = hf_llama(ckpt)
    adapters = []
    for i in range(4):
        out = tmp_path_factory.mktemp(f"ad{i}")
        config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
        make_adapter(base, out, {**config, "init_lora_weights": False}, seed=20 + i, b_scale=1.0)
        adapters.append(LoRARequest(f"ad{i}", i + 1, str(out)))
    return {"ckpt": ckpt, "base": base, "adapters": adapters}


@pytest.fixture(scope="module")
def llm(setup) -> LLM:
    """One engine with adapters, shared by the tests that leave it as they found it."""
    return LLM(setup["ckpt"], enable_lora=True, max_loras=2, max_cpu_loras=8)


# ---- the adapter format -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("use_dora", True),
        ("bias", "all"),
        ("bias", "lora_only"),
        ("modules_to_save", ["lm_head"]),
        ("fan_in_fan_out", True),
    ],
)
def test_peft_options_the_engine_cannot_serve_are_refused_by_name(setup, llm, tmp_path, field, value):
    """DoRA, LoRA biases, ``modules_to_save`` and ``fan_in_fan_out`` change what an adapter
    computes beyond ``B @ A``: serving such an adapter as plain LoRA would give wrong tokens, so
    it is refused naming the option, and nothing is kept."""
    good = setup["adapters"][0]
    bad = tmp_path / "bad"
    shutil.copytree(good.lora_path, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config[field] = value
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPT], _greedy(), lora_request=LoRARequest("bad", 99, str(bad)))
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([PROMPT], _greedy(), lora_request=LoRARequest("bad", 99))
    llm.generate([PROMPT], _greedy(), lora_request=good)  # the refusals left the engine serving


def test_alpha_pattern_sets_a_modules_scale(setup, llm, tmp_path):
    """PEFT's ``alpha_pattern`` gives a module its own alpha: the engine equals PEFT with it,
    and the same weights served without it disagree (so the pattern was read)."""
    config = {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "alpha_pattern": {"down_proj": 32, "v_proj": 1},
        "init_lora_weights": False,
    }
    reference = make_adapter(setup["base"], tmp_path / "pattern", config, seed=7, b_scale=1.0)
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "pattern", plain)
    raw = json.loads((plain / "adapter_config.json").read_text())
    assert raw["alpha_pattern"] == config["alpha_pattern"]
    raw["alpha_pattern"] = {}
    (plain / "adapter_config.json").write_text(json.dumps(raw))
    outs = llm.generate(
        [PROMPT, PROMPT],
        _greedy(6),
        lora_request=[
            LoRARequest("pattern", 50, str(tmp_path / "pattern")),
            LoRARequest("plain", 51, str(plain)),
        ],
    )
    assert _logprob_gap(reference, PROMPT, outs[0]) < 1e-4
    assert _logprob_gap(reference, PROMPT, outs[1]) > 1e-3


# ---- enable_lora's refusals ---------------------------------------------------------------


@pytest.mark.parametrize(
    "option,match",
    [
        ({"batch_invariant": True}, "batch_invariant"),
        ({"enable_return_routed_experts": True}, "enable_return_routed_experts"),
        ({"data_parallel_size": 2}, "one rank"),
        ({"data_parallel_replicas": 2}, "one replica"),
    ],
)
def test_enable_lora_refuses_what_it_does_not_run_with(setup, option, match):
    """The modes adapters do not run in are refused with the reason, before any weights are
    loaded or ranks started (CUDA graphs and tensor parallel run them on Llama: the
    features-and-modes test checks those cells)."""
    with pytest.raises(ValueError, match=rf"enable_lora=True.*{match}"):
        LLM(setup["ckpt"], enable_lora=True, **option)


# ---- streaming ----------------------------------------------------------------------------


def test_stream_takes_a_lora_request(setup, llm):
    """``LLM.stream(lora_request=)`` streams the adapter's tokens and logprobs, the ones
    ``generate`` gives with it, not the base model's."""
    adapter = setup["adapters"][1]
    params = _greedy(6, logprobs=1)
    whole = llm.generate([PROMPT], params, lora_request=adapter)[0].outputs[0]
    base = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    deltas = list(llm.stream(PROMPT, params, lora_request=adapter))
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    logprobs = [e for d in deltas for e in d.outputs[0].logprobs]
    assert tokens == whole.token_ids and tokens != base
    assert [{t: lp.logprob for t, lp in e.items()} for e in logprobs] == [
        {t: lp.logprob for t, lp in e.items()} for e in whole.logprobs
    ]
    assert deltas[-1].finished


# ---- scheduling and keeping adapters ------------------------------------------------------


def test_at_most_max_loras_distinct_adapters_run_at_once(setup, llm):
    """With ``max_loras=2`` and three adapters, a request whose adapter would be the third
    waits for a running adapter's requests to end, while a second request of a running adapter
    joins at once. Every request still gets its tokens alone."""
    a, b, c = setup["adapters"][:3]
    loras = [a, None, a, b, c]
    prompts = [[7 + i, 40, 50, 60, 70] for i in range(len(loras))]
    params = _greedy(6)
    alone = [
        llm.generate([p], params, lora_request=r)[0].outputs[0].token_ids
        for p, r in zip(prompts, loras, strict=True)
    ]
    outs = llm.generate(prompts, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == alone
    spans = [(o.metrics.first_scheduled_time, o.metrics.finished_time) for o in outs]

    def running_at(t: float) -> set[str]:
        """The adapters of the requests between their first step and their end at ``t``."""
        return {r.lora_name for r, (start, end) in zip(loras, spans, strict=True) if r and start <= t < end}

    most = max(len(running_at(start)) for start, _ in spans)
    assert most == 2  # the limit was reached, never passed
    a_ends, b_ends = max(spans[0][1], spans[2][1]), spans[3][1]
    assert spans[4][0] >= min(a_ends, b_ends)  # "c" waited for "a" or "b" to end


def test_adapters_requests_bring_are_dropped_least_recently_used_first(setup):
    """``max_cpu_loras`` bounds the adapters held by name: once full, the least recently used
    adapter a request brought is dropped (its name must bring its path again), an explicitly
    loaded adapter stays pinned, and an adapter used again is kept."""
    pinned, a, b, c = setup["adapters"]
    llm = LLM(setup["ckpt"], enable_lora=True, max_loras=1, max_cpu_loras=3)
    llm.engine.lora.load(pinned.lora_name, pinned.lora_path, pinned.lora_int_id)
    by_name = {r.lora_name: LoRARequest(r.lora_name, r.lora_int_id) for r in (pinned, a, b, c)}
    llm.generate([PROMPT], _greedy(2), lora_request=a)
    llm.generate([PROMPT], _greedy(2), lora_request=b)
    llm.generate([PROMPT], _greedy(2), lora_request=by_name[a.lora_name])  # "a" used again
    llm.generate([PROMPT], _greedy(2), lora_request=c)  # full: "b" is the least recently used
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([PROMPT], _greedy(2), lora_request=by_name[b.lora_name])
    for kept in (pinned, a, c):  # still loaded: served without a path to load from
        llm.generate([PROMPT], _greedy(2), lora_request=by_name[kept.lora_name])


# ---- the base model with enable_lora ------------------------------------------------------


def test_a_step_without_adapters_runs_as_without_enable_lora(setup, llm):
    """Requests without an adapter, on an engine whose slots hold adapters, give bit for bit
    the tokens and logprobs of an engine without ``enable_lora`` (prefill and decode steps,
    batched), so serving adapters costs the base model nothing in accuracy."""
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 100, 101, 102], [200, 3]]
    params = _greedy(8, logprobs=5)
    llm.generate([PROMPT, PROMPT], _greedy(3), lora_request=setup["adapters"][:2])  # slots filled

    def result(engine: LLM, lora_request=None) -> list:
        outs = engine.generate(prompts, params, lora_request=lora_request)
        return [
            (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outs
        ]

    expected = result(LLM(setup["ckpt"], **EAGER))
    assert result(llm) == expected
    assert result(llm, [setup["adapters"][0], None, None])[0] != expected[0]  # adapters do change tokens
