"""Served LoRA adapters against transformers + PEFT, and mixed-adapter batches against each
request alone.

References: SmolLM2 and a tiny Llama run in transformers wrapped by PEFT (unmerged, and merged
with ``merge_and_unload``); the tiny DeepSeek-V4 with adapters on attention, compressors,
indexers, shared and routed experts runs in transformers' own DeepseekV4ForCausalLM on the
merged weights, and in deepinfer's research module wrapped by PEFT (unmerged); the tiny
V4.1 runs in the independent dense reference (``tests/support/v41_reference.py``, which reads the
checkpoint itself) on the merged weights, and in the research module wrapped by PEFT.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_adapters import (
    LLAMA_TARGETS,
    V4_TARGETS,
    hf_llama,
    make_adapter,
    merged_checkpoint,
    random_lora_config,
)
from safetensors.torch import load_file, save_file
from spec_prompts import repeating_prompts
from v41_reference import read_checkpoint, reference_logits

from deepinfer import LLM, LoRARequest, SamplingParams, load_model
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.catalog import resolve_model

TOL = 1e-4


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)


def _check_against(reference: torch.nn.Module, prompt: list[int], out, tol: float = TOL) -> None:
    """``out``'s greedy tokens are the reference's argmax at every position, and its logprobs
    equal the reference's within ``tol``."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].float()
    _check_logits(logits, prompt, out, tol)


def _check_logits(logits: torch.Tensor, prompt: list[int], out, tol: float = TOL) -> None:
    """``_check_against`` given the reference's logits [S, V] over the prompt and the output."""
    tokens = out.outputs[0].token_ids
    logprobs = logits.float().log_softmax(-1)[len(prompt) - 1 : -1]
    assert logprobs.argmax(-1).tolist() == tokens
    ours = torch.tensor([out.outputs[0].logprobs[k][t].logprob for k, t in enumerate(tokens)])
    theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (ours - theirs).abs().max().item() < tol


# ---- SmolLM2 and a tiny Llama against transformers + PEFT --------------------------------


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory):
    path = resolve_model("smollm2-135m")
    base = hf_llama(path)
    rng = random.Random(5)
    adapters = []
    for i in range(3):
        config = random_lora_config(rng, LLAMA_TARGETS)
        out = tmp_path_factory.mktemp(f"smol{i}")
        adapters.append((out, make_adapter(base, out, config, seed=i)))
    return path, base, adapters


def test_smollm2_adapters_match_transformers_peft(smollm2_adapters):
    """Three random adapters and the base model in one mixed batch: each row equals
    transformers + PEFT unmerged and merged (tokens, and logprobs within 1e-4)."""
    path, base, adapters = smollm2_adapters
    llm = LLM(path, enable_lora=True, max_loras=3)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 17, 2893, 30, 4521, 11, 198, 42, 1100, 3, 86]]
    requests = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, (p, _) in enumerate(adapters)]
    jobs = [(prompt, r) for prompt in prompts for r in requests]
    outs = llm.generate([p for p, _ in jobs], _greedy(8), lora_request=[r for _, r in jobs])
    references = [base] + [m for _, m in adapters]
    merged = [None] + [copy.deepcopy(m).merge_and_unload().eval() for _, m in adapters]
    for k, ((prompt, _), out) in enumerate(zip(jobs, outs, strict=True)):
        _check_against(references[k % len(requests)], prompt, out)
        if merged[k % len(requests)] is not None:
            _check_against(merged[k % len(requests)], prompt, out)
    # the adapters change what is generated (the comparison above is not vacuous)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[: len(requests)]}) > 1


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    """A tiny Llama and eight PEFT adapters of random setups."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=4)
    base = hf_llama(ckpt)
    rng = random.Random(11)
    adapters = []
    for i in range(8):
        out = tmp_path_factory.mktemp(f"ad{i}")
        model = make_adapter(base, out, random_lora_config(rng, LLAMA_TARGETS), seed=100 + i, b_scale=1.0)
        adapters.append((LoRARequest(f"ad{i}", i + 1, str(out)), model))
    return ckpt, base, adapters


def test_scale_mutation_is_caught(llama_setup, monkeypatch):
    """Mutation check: an engine that ignores the adapter's scale (alpha / r) disagrees with
    PEFT, so the comparison above can fail."""
    from deepinfer.lora import peft_format

    ckpt, _, adapters = llama_setup
    request, model = adapters[0]
    prompt = [5, 77, 12, 140, 3, 61]
    good = LLM(ckpt, enable_lora=True).generate([prompt], _greedy(6), lora_request=request)[0]
    _check_against(model, prompt, good)
    original = peft_format.ModuleUpdate
    monkeypatch.setattr(peft_format, "ModuleUpdate", lambda a, b, scale: original(a, b, 1.0))
    bad = LLM(ckpt, enable_lora=True).generate([prompt], _greedy(6), lora_request=request)[0]
    with pytest.raises(AssertionError):
        _check_against(model, prompt, bad)


# ---- mixed batches: batching, chunking, preemption, slot reuse ----------------------------

ENGINE_MODES = {
    "batched": {"max_loras": 8},
    "chunked": {"max_loras": 8, "max_num_batched_tokens": 7},
    "preempted": {"max_loras": 8, "num_cache_blocks": 10, "block_size": 4},
    "three_slots": {"max_loras": 3, "max_cpu_loras": 4, "max_num_batched_tokens": 16},
    "async_three_slots": {
        "max_loras": 3,
        "max_cpu_loras": 4,
        "max_num_batched_tokens": 16,
        "async_scheduling": True,
    },
    "async_preempted": {"max_loras": 8, "num_cache_blocks": 10, "block_size": 4, "async_scheduling": True},
}


@pytest.fixture(scope="module")
def mixed_engines(llama_setup):
    ckpt = llama_setup[0]
    alone = LLM(ckpt, enable_lora=True, max_loras=1)
    return alone, {name: LLM(ckpt, enable_lora=True, **opts) for name, opts in ENGINE_MODES.items()}


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(3, 250), min_size=1, max_size=14),  # prompt
        st.integers(-1, 7),  # adapter (-1: the base model)
        st.integers(1, 9),  # max_tokens
    ),
    min_size=8,
    max_size=12,
)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads)
def test_mixed_adapter_batch_equals_each_alone(llama_setup, mixed_engines, workload):
    """A batch mixing up to eight adapters and the base model gives every request the tokens
    it gets alone, batched, chunked, preempted, and with fewer slots than adapters."""
    _, _, adapters = llama_setup
    alone, modes = mixed_engines
    workload = workload + [([9, 8, 7, 6], a, 3) for a in range(8)]  # all eight adapters at once
    requests = [None if a < 0 else adapters[a][0] for _, a, _ in workload]
    params = [_greedy(n) for _, _, n in workload]
    prompts = [p for p, _, _ in workload]
    expected = [
        alone.generate([p], sp, lora_request=r)[0].outputs[0].token_ids
        for p, sp, r in zip(prompts, params, requests, strict=True)
    ]
    for name, llm in modes.items():
        outs = llm.generate(prompts, params, lora_request=requests)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == expected, name


def _slot_tensors(registry) -> list[torch.Tensor]:
    """Copies of every slot tensor of the registry's linear targets."""
    from deepinfer.lora.targets import stack_for

    out = []
    for target in registry.targets.values():
        stack = stack_for(target, registry.max_loras, registry.max_rank, registry.dtype, registry.device)
        out += [stack.a.clone(), *(b.clone() for b in stack.b)]
    return out


@pytest.mark.parametrize("mutant", [False, True])
def test_a_prepared_step_leaves_the_slots_to_the_step_in_flight(llama_setup, monkeypatch, mutant):
    """Under asynchronous scheduling a step is prepared while the one before it runs: the slot
    it gives a new adapter (evicting one the running step may read) is written only when the
    step itself runs (``write_slots``, on the thread that runs steps in order). Mutation: a
    slot written as the step is prepared changes the running step's slots."""
    from deepinfer.lora.registry import LoraRegistry

    ckpt, _, adapters = llama_setup
    if mutant:
        original = LoraRegistry.step

        def written_when_prepared(self, chunk_adapters, lengths, rows):
            step = original(self, chunk_adapters, lengths, rows)
            if step is not None:
                step.write_slots()
            return step

        monkeypatch.setattr(LoraRegistry, "step", written_when_prepared)
    llm = LLM(ckpt, enable_lora=True, max_loras=2, max_cpu_loras=3)
    registry = llm.engine.lora
    a, b, c = (registry.resolve(r) for r, _ in adapters[:3])
    running = registry.step([a, b], [2, 3], 5)
    running.write_slots()
    before = _slot_tensors(registry)
    prepared = registry.step([c], [4], 4)  # takes the slot of a or b
    during = _slot_tensors(registry)
    assert all(torch.equal(x, y) for x, y in zip(before, during, strict=True)) != mutant
    prepared.write_slots()
    after = _slot_tensors(registry)
    assert not all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_speculative_decoding_with_adapters_changes_no_token(llama_setup, mixed_engines):
    """n-gram drafts verified by rows of several adapters: every request gets the tokens it
    gets alone without drafts, and drafts were accepted (the check is not vacuous)."""
    _, _, adapters = llama_setup
    alone, _ = mixed_engines
    prompts = repeating_prompts(8, seed=5)
    requests = [a for a, _ in adapters]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [
        alone.generate([p], params, lora_request=r)[0].outputs[0].token_ids
        for p, r in zip(prompts, requests, strict=True)
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(llama_setup[0], enable_lora=True, max_loras=4, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests)]
    assert got == expected
    assert llm.engine.spec.stats.accepted > 0


def test_preemption_happens_in_the_preempted_mode(llama_setup, mixed_engines):
    """The "preempted" engine does preempt mixed-adapter requests (the mode is not vacuous)."""
    _, _, adapters = llama_setup
    llm = mixed_engines[1]["preempted"]
    prompts = [[3 + i, 40, 50, 60, 70, 80, 90] for i in range(8)]
    seen = []
    add = llm.engine.scheduler.preempt

    def spy(request):
        seen.append(request.lora)
        add(request)

    llm.engine.scheduler.preempt = spy
    try:
        llm.generate(prompts, _greedy(9), lora_request=[a for a, _ in adapters])
    finally:
        llm.engine.scheduler.preempt = add
    assert any(lora is not None for lora in seen)


def test_slot_mutation_is_caught(llama_setup, mixed_engines, monkeypatch):
    """Mutation check: rows given the wrong adapter slot (one chunk's slot for every row) make
    the mixed batch differ from the requests alone."""
    from deepinfer.lora.registry import LoraRegistry

    _, _, adapters = llama_setup
    alone, _ = mixed_engines
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24], [31, 32, 33]]
    requests = [adapters[0][0], adapters[1][0], adapters[2][0]]
    expected = [
        alone.generate([p], _greedy(6), lora_request=r)[0].outputs[0].token_ids
        for p, r in zip(prompts, requests, strict=True)
    ]
    original = LoraRegistry.step

    def first_slot_everywhere(self, chunk_adapters, lengths, rows):
        return original(self, [chunk_adapters[0]] * len(chunk_adapters), lengths, rows)

    monkeypatch.setattr(LoraRegistry, "step", first_slot_everywhere)
    llm = LLM(llama_setup[0], enable_lora=True, max_loras=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(6), lora_request=requests)]
    assert got != expected


def test_prefix_cache_is_keyed_by_adapter(llama_setup):
    """Blocks computed with one adapter are never served to another (or to the base model);
    the same adapter reuses them."""
    ckpt, _, adapters = llama_setup
    llm = LLM(ckpt, enable_lora=True, max_loras=2, block_size=4)
    prompt = list(range(10, 30))
    a, b = adapters[0][0], adapters[1][0]
    first = llm.generate([prompt], _greedy(2), lora_request=a)[0]
    same = llm.generate([prompt], _greedy(2), lora_request=a)[0]
    other = llm.generate([prompt], _greedy(2), lora_request=b)[0]
    base = llm.generate([prompt], _greedy(2))[0]
    assert first.num_cached_tokens == 0 and same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


# ---- the tiny DeepSeek-V4: attention, compressors, indexers and experts --------------------


def test_v4_adapters_on_experts_match_merged_weights_and_peft(v4_ckpt, hf_reference, tmp_path):
    """An adapter on every V4 target (routed experts included) served beside the base model
    equals transformers' DeepseekV4 on the merged weights and deepinfer's research module
    wrapped by PEFT (unmerged)."""
    research = load_model(v4_ckpt)
    config = {"r": 4, "lora_alpha": 8, "target_modules": list(V4_TARGETS), "init_lora_weights": False}
    peft_model = make_adapter(research, tmp_path / "ad", config, seed=3, b_scale=0.5)
    merged = hf_reference(merged_checkpoint(Path(v4_ckpt), tmp_path / "ad", tmp_path / "merged"))
    llm = LLM(v4_ckpt, enable_lora=True, max_loras=2)
    request = LoRARequest("v4", 1, str(tmp_path / "ad"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (3, 9, 21)]
    outs = llm.generate(prompts * 2, _greedy(10), lora_request=[request] * 3 + [None] * 3)
    for prompt, out in zip(prompts, outs[:3], strict=True):
        _check_against(merged, prompt, out)
        _check_against(peft_model, prompt, out)
    assert [o.outputs[0].token_ids for o in outs[:3]] != [o.outputs[0].token_ids for o in outs[3:]]
    registry = llm.engine.lora  # the adapter reached every kind of target, routed experts too
    kinds = {registry.targets[m].kind for m in registry.adapters["v4"].adapter.updates}
    assert kinds == {"module", "expert"}


def test_v41_adapters_match_the_reference_on_merged_weights(v41_ckpt, tmp_path):
    """V4.1 (shared-KV attention, Engram, two-level indexer): an adapter on every target the
    registry finds, served beside the base model, equals the independent dense reference
    (``v41_reference``, which reads the checkpoint itself and shares no code with the engine)
    run on a checkpoint with ``W + scale * B @ A`` written into its weights, with V4.1's QAT
    rounding as the engine applies it by default; and the PEFT-wrapped research module (the
    LoRA arithmetic against PEFT's)."""
    from deepinfer.lora.targets import find_targets

    research = load_model(v41_ckpt)
    assert research.config.fake_quant  # what the reference is run with below
    targets = sorted({name.rsplit(".", 1)[1] for name in find_targets(research)})
    config = {"r": 3, "lora_alpha": 6, "target_modules": targets, "init_lora_weights": False}
    peft_model = make_adapter(research, tmp_path / "ad", config, seed=4, b_scale=0.5)
    merged = merged_checkpoint(Path(v41_ckpt), tmp_path / "ad", tmp_path / "merged")
    # the merge reached every adapted module (it skips a name the checkpoint lacks)
    adapted = sum(
        k.endswith("lora_A.weight") for k in load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    )
    base, written = _tensors(Path(v41_ckpt)), _tensors(merged)
    assert adapted > 0 and sum(not torch.equal(base[k], written[k]) for k in base) == adapted
    reference = read_checkpoint(merged)
    llm = LLM(v41_ckpt, enable_lora=True)
    request = LoRARequest("v41", 1, str(tmp_path / "ad"))
    prompts = [[5, 17, 99, 3, 42, 7, 8, 9], [200, 4, 61]]
    outs = llm.generate(prompts * 2, _greedy(8), lora_request=[request] * 2 + [None] * 2)
    for prompt, out in zip(prompts, outs[:2], strict=True):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        _check_logits(reference_logits(reference, ids, fake_quant=True)[0], prompt, out)
        _check_against(peft_model, prompt, out)
    assert [o.outputs[0].token_ids for o in outs[:2]] != [o.outputs[0].token_ids for o in outs[2:]]


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    return {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


# ---- bad input -------------------------------------------------------------------------


def test_bad_adapters_are_refused_and_leave_the_served_ones(llama_setup, tmp_path):
    ckpt, base, adapters = llama_setup
    llm = LLM(ckpt, enable_lora=True, max_loras=2, max_lora_rank=8)
    good, _ = adapters[0]
    prompt = [5, 6, 7, 8]
    before = llm.generate([prompt], _greedy(5), lora_request=good)[0].outputs[0].token_ids
    registry = llm.engine.lora
    with pytest.raises(ValueError, match="not a directory"):
        registry.load("missing", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        registry.load("empty", str(tmp_path / "empty"))
    wide = make_adapter(base, tmp_path / "wide", {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}, 0)
    assert wide is not None
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        registry.load("wide", str(tmp_path / "wide"))
    wider = base.config.intermediate_size + 32  # an adapter trained on a model of another shape
    other = hf_llama(make_tiny_checkpoint(tmp_path / "other", arch="llama", seed=0, intermediate_size=wider))
    make_adapter(other, tmp_path / "other_ad", {"r": 2, "lora_alpha": 2, "target_modules": ["down_proj"]}, 0)
    with pytest.raises(ValueError, match="base-model mismatch"):
        registry.load("other", str(tmp_path / "other_ad"))
    unknown = tmp_path / "unknown"  # a good adapter with one module renamed
    unknown.mkdir()
    source = Path(good.lora_path)
    (unknown / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    key = next(iter(tensors))
    renamed = key.replace("layers.0.", "layers.0.extra.", 1)
    tensors = {(renamed if k == key else k): v for k, v in tensors.items()}
    save_file(tensors, str(unknown / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="not a linear this model serves"):
        registry.load("unknown", str(unknown))
    with pytest.raises(ValueError, match="lora_int_id"):
        llm.generate([prompt], _greedy(2), lora_request=LoRARequest(good.lora_name, 99, good.lora_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "p")
    with pytest.raises(ValueError, match="lora_request must be"):
        llm.generate([prompt, prompt], _greedy(2), lora_request=[good])
    assert sorted(registry.adapters) == [good.lora_name]
    after = llm.generate([prompt], _greedy(5), lora_request=good)[0].outputs[0].token_ids
    assert after == before


def test_lora_needs_enable_lora(llama_setup):
    ckpt, _, adapters = llama_setup
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(ckpt).generate([[5, 6]], _greedy(2), lora_request=adapters[0][0])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(ckpt, enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_unloaded_adapter_lets_running_requests_finish(llama_setup):
    """Unloading refuses new requests naming the adapter; requests already queued finish
    with it."""
    ckpt, _, adapters = llama_setup
    llm = LLM(ckpt, enable_lora=True)
    request, model = adapters[3]
    llm.engine.lora.load(request.lora_name, request.lora_path, request.lora_int_id)
    named = LoRARequest(request.lora_name, request.lora_int_id)  # no path: must be loaded
    req = llm.engine.add_request("r", [5, 6, 7], _greedy(4), lora_request=named)
    llm.engine.lora.unload(request.lora_name)
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([[5, 6, 7]], _greedy(4), lora_request=named)
    while not req.finished:
        llm.engine.step()
    out = llm.engine.make_output(req)
    _check_against(model, [5, 6, 7], out)


# ---- the grouped product against the per-row formula --------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 5),
    rank=st.integers(1, 6),
    outs=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    rows=st.lists(st.integers(-1, 4), min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
    form=st.sampled_from(["aten-fp64", "aten-fp32", "kernel-fp32", "op-mask-fp64", "op-cpu-fp32"]),
)
def test_grouped_product_equals_each_rows_own_adapter(slots, rank, outs, rows, seed, form):
    """Any mix of slots, ranks and row counts (ATen's padded and per-run forms in float64 and
    float32, the CPU kernel in float32; a compiled step's ``deepinfer::lora_add``: its
    graph-safe mask form in float64, its CPU kernel in float32): every row gets
    ``scale * x @ A.T @ B.T`` of its own slot's adapter and a base row gets nothing."""
    from unittest import mock

    from deepinfer.kernels import lora_op
    from deepinfer.kernels.cpu import lora as cpu_lora

    from deepinfer.models.layers.lora import LinearStack, LoraStep

    dtype = torch.float64 if form.endswith("fp64") else torch.float32

    gen = torch.Generator().manual_seed(seed)
    slot_rows = torch.tensor([r if r < slots else -1 for r in rows])
    width = 7 if seed % 2 else 150  # within one of the kernel's blocks of products, or over three
    stack = LinearStack(width, outs, slots, rank, dtype, torch.device("cpu"))
    updates = {}
    for slot in range(slots):
        for i, out in enumerate(outs):
            r = int(torch.randint(1, rank + 1, (1,), generator=gen))
            a, b = torch.randn(r, width, generator=gen).double(), torch.randn(out, r, generator=gen).double()
            scale = float(torch.rand(1, generator=gen)) + 0.5
            stack.load(slot, i, a.to(dtype), b.to(dtype), scale)
            updates[slot, i] = scale * b @ a
    stack.clear(slots - 1)  # a cleared slot adds nothing
    x = torch.randn(len(rows), width, generator=gen).double()
    y = torch.randn(len(rows), sum(outs), generator=gen).double()
    step = LoraStep.build(slot_rows, slots, rank, dtype, torch.device("cpu"))
    assert form != "kernel-fp32" or cpu_lora.supports(x.to(dtype), y.to(dtype))
    if form == "aten-fp32":
        path = mock.patch.object(cpu_lora, "supports", side_effect=lambda *_: False)
    else:  # the kernel takes every group size here, not only decode-sized ones
        path = mock.patch.object(cpu_lora, "BLOCK_ROWS", 10**6)
    if form == "op-mask-fp64":
        got = lora_op.reference(y, x, slot_rows, stack.a, stack.b, rank)
    elif form == "op-cpu-fp32":
        got = lora_op.lora_add(y.to(dtype), x.to(dtype), slot_rows, stack.a, stack.b, rank).double()
    else:
        with path:
            got = stack.add_to(y.to(dtype, copy=True), x.to(dtype), step).double()
    expected = y.clone()
    for t, slot in enumerate(slot_rows.tolist()):
        if slot >= 0 and slot != slots - 1:
            expected[t] += torch.cat([updates[slot, i] @ x[t] for i in range(len(outs))])
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("mutant", [False, True])
def test_the_one_call_stack_adds_the_adapters_terms(llama_setup, monkeypatch, mutant):
    """Decode steps holding adapter rows run the one-call CPU stack, which adds each row's
    low-rank terms after each projection as the layer loop does: tokens and logprobs equal
    the layer loop's. Mutation: the stack run without the terms differs."""
    from deepinfer.engine import setup as engine_setup
    from deepinfer.engine.cpu_decode import OneCallDecode

    ckpt, _, adapters = llama_setup
    prompts = [[21 + i, 22, 23, 24, 25, 26][: 3 + i % 4] for i in range(8)]
    requests = [adapters[i % 4][0] if i % 3 else None for i in range(8)]

    def run(**patches) -> tuple[list, LLM]:
        with monkeypatch.context() as m:
            for patch in patches.values():
                m.setattr(*patch)
            llm = LLM(ckpt, enable_lora=True, max_loras=4, compile=False)
            outs = llm.generate(prompts, _greedy(6), lora_request=requests)
        return [
            (
                o.outputs[0].token_ids,
                [max(d.values(), key=lambda v: v.logprob).logprob for d in o.outputs[0].logprobs],
            )
            for o in outs
        ], llm

    loop, _ = run(off=(engine_setup, "one_call_decode", lambda model: None))
    used = []
    original = OneCallDecode.lora_terms

    def counted(self, step, h):
        terms = original(self, step, h)
        used.append(terms is not None)
        return None if mutant else terms

    got, llm = run(spy=(OneCallDecode, "lora_terms", counted))
    assert isinstance(llm.engine.runner.forward, OneCallDecode) and any(used)
    same = all(
        t == u and max(abs(a - b) for a, b in zip(p, q, strict=True)) < 1e-5
        for (t, p), (u, q) in zip(got, loop, strict=True)
    )
    assert same != mutant


def test_a_step_that_never_ran_leaves_its_slot_fills_to_the_next(llama_setup):
    """A step prepared and never run (it failed) did not fill the slot it gave an adapter;
    the next step using that adapter fills it, and a fill runs once."""
    ckpt, _, adapters = llama_setup
    llm = LLM(ckpt, enable_lora=True, max_loras=2, max_cpu_loras=3)
    registry = llm.engine.lora
    a = registry.resolve(adapters[0][0])
    empty = _slot_tensors(registry)
    registry.step([a], [3], 3)  # prepared, never run
    assert all(torch.equal(x, y) for x, y in zip(empty, _slot_tensors(registry), strict=True))
    step = registry.step([a], [2], 2)
    assert len(step.slot_writes) == 1
    step.write_slots()
    filled = _slot_tensors(registry)
    assert not all(torch.equal(x, y) for x, y in zip(empty, filled, strict=True))
    assert registry.step([a], [1], 1).slot_writes == ()


@pytest.mark.parametrize("mutant", [False, True])
def test_compiled_steps_add_the_adapters_terms(llama_setup, monkeypatch, mutant):
    """A compiled step (Inductor, padded rows) hands each row's slot to ``deepinfer::lora_add``
    and gives a mixed batch the eager engine's tokens. Mutation: the op's CPU form reading
    every row as slot 0 differs."""
    from deepinfer.kernels import lora_op

    ckpt, _, adapters = llama_setup
    prompts = [[31 + i, 32, 33, 34, 35][: 2 + i % 4] for i in range(7)]
    requests = [adapters[i % 3][0] if i % 4 else None for i in range(7)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(**options) -> list:
        llm = LLM(ckpt, enable_lora=True, max_loras=2, max_num_seqs=4, **options)
        outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        assert (llm.engine.runner.padding is not None) == options["compile"]
        return [o.outputs[0].token_ids for o in outs]

    expected = run(compile=False)
    if mutant:
        real = lora_op._cpu

        def slot_zero(y, x, slot_rows, a, bs, rank):
            return real(y, x, torch.where(slot_rows >= 0, 0, -1), a, bs, rank)

        monkeypatch.setattr(lora_op, "_cpu", slot_zero)
        lora_op.lora_add.register_kernel("cpu")(lambda *args: lora_op._cpu(*args))
    torch._dynamo.reset()
    try:
        got = run(compile=True, capture_graphs=False)
    finally:
        if mutant:
            lora_op.lora_add.register_kernel("cpu")(real)
    assert (got == expected) != mutant


def test_compile_graphs_or_tensor_parallel_with_adapters_on_routed_experts_is_refused(v4_ckpt):
    with pytest.raises(ValueError, match="set compile=False"):
        LLM(str(v4_ckpt), enable_lora=True, compile=True)
    with pytest.raises(ValueError, match="set capture_graphs=False"):
        LLM(str(v4_ckpt), enable_lora=True, capture_graphs=True)
    with pytest.raises(ValueError, match=r"run on one rank \(tensor_parallel_size=1\)"):
        LLM(str(v4_ckpt), enable_lora=True, tensor_parallel_size=2)
