"""Weight updates for RL: an engine over the module being trained (``LLM.from_model``) follows
the trainer's in-place writes, and ``update_weights`` / ``load_weights_from_disk`` change a
checkpoint engine's weights; either way the outputs equal those of an engine built afresh
from a checkpoint of the new weights, no K/V of the old weights is read again (running
requests are recomputed, no cached prefix is reused), and a bad update changes nothing.
Mutation checks: an engine whose derived copies are not remade, or whose prefix cache is
kept, gives the old weights' outputs."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rl_steps import save_checkpoint, tokens_and_logprob_dicts, train_step

from deepinfer import LLM, SamplingParams
from deepinfer.engine.block_pool import BlockPool
from deepinfer.errors import CheckpointError
from deepinfer.models.layers.projection import Projection
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.writer import write_safetensors

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
ARCH_OPTIONS = {
    "llama": dict(head_dim=64, hidden_size=256),
    "deepseek_v4": {},
    "deepseek_v41": {},
}


def _checkpoint(tmp_path_factory, arch: str, seed: int = 3):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, seed=seed, **ARCH_OPTIONS[arch])


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 250, (40,), generator=gen).tolist()
    return [shared + torch.randint(2, 250, (int(n),), generator=gen).tolist() for n in (3, 11, 27)]


# ---- LLM.from_model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,options",
    [
        ("llama", {}),
        ("llama", {"compile": False}),
        ("llama", {"async_scheduling": True}),
        ("llama", {"quantization": "int8", "compile": False}),
        ("llama", {"quantization": "int4", "compile": False}),
        ("deepseek_v4", {}),
        ("deepseek_v41", {}),
    ],
)
def test_an_engine_over_the_trainers_module_follows_its_steps(tmp_path_factory, arch, options):
    path = _checkpoint(tmp_path_factory, arch)
    model = load_model(path, requires_grad=True)
    llm = LLM.from_model(model, **options)

    # V4 compiles its step (the CPU default), twice an example: one example there
    @settings(
        max_examples=1 if arch == "deepseek_v4" else 2, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(seed=st.integers(0, 2**16))
    def check(seed):
        prompts = _prompts(seed)
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # caches the shared prefix
        before = llm.weight_version
        train_step(model, seed, 0.05, 24)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert int(got[0].weight_version) == int(before) + 1
        saved = save_checkpoint(model, path, tmp_path_factory.mktemp("step") / "ckpt")
        assert tokens_and_logprob_dicts(got) == tokens_and_logprob_dicts(
            LLM(saved, **options).generate(prompts, GREEDY, use_tqdm=False)
        )

    check()


def test_a_copy_not_remade_is_caught(tmp_path_factory, monkeypatch):
    """Mutation check: projections whose packed copies are not remade keep the old weights."""
    path = _checkpoint(tmp_path_factory, "llama")
    model = load_model(path, requires_grad=True)
    llm = LLM.from_model(model, compile=False)
    prompts = _prompts(1)
    old = tokens_and_logprob_dicts(llm.generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setattr(Projection, "refresh", lambda self: None)
    train_step(model, 1, 0.5, 24)
    saved = save_checkpoint(model, path, tmp_path_factory.mktemp("step") / "ckpt")
    stale = tokens_and_logprob_dicts(llm.generate(prompts, GREEDY, use_tqdm=False))
    fresh = tokens_and_logprob_dicts(LLM(saved, compile=False).generate(prompts, GREEDY, use_tqdm=False))
    assert stale != fresh and stale != old  # the norms and embedding moved, the projections did not


def test_a_parameter_replaced_by_new_storage_is_refused(tmp_path_factory):
    model = load_model(_checkpoint(tmp_path_factory, "llama"), requires_grad=True)
    llm = LLM.from_model(model)
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.data = weight.data.clone()
    with pytest.raises(RuntimeError, match=r"q_proj\.weight.*in place"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


def test_from_model_refuses_what_it_cannot_share(tmp_path_factory):
    model = load_model(_checkpoint(tmp_path_factory, "llama"), requires_grad=True)
    with pytest.raises(TypeError, match="deepinfer model"):
        LLM.from_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="dtype"):
        LLM.from_model(model, dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM.from_model(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM.from_model(model).generate("text")


# ---- update_weights / load_weights_from_disk ----------------------------------------------


@pytest.fixture(scope="module")
def two_llamas(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "llama", 3), _checkpoint(tmp_path_factory, "llama", 4)


def test_update_weights_gives_the_new_checkpoints_outputs(two_llamas):
    old, new = two_llamas
    prompts = _prompts(2)
    expected = tokens_and_logprob_dicts(LLM(new).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(old)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # caches the shared prefix under the old weights
    hits = llm.engine.block_pools[0].hit_blocks
    state = load_model(new).state_dict()
    assert (
        llm.update_weights({f"module.{n}": t for n, t in state.items()}, weight_version="step-1") == "step-1"
    )
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens_and_logprob_dicts(got) == expected and {o.weight_version for o in got} == {"step-1"}
    assert llm.engine.block_pools[0].hit_blocks == hits  # no block cached under the old weights was reused
    llm2 = LLM(old)
    assert llm2.load_weights_from_disk(new) == "1"
    assert tokens_and_logprob_dicts(llm2.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_a_prefix_of_the_old_weights_reused_is_caught(two_llamas, monkeypatch):
    """Mutation check: an update that keeps the prefix cache reads the old weights' K/V."""
    old, new = two_llamas
    prompts = _prompts(2)
    expected = tokens_and_logprob_dicts(LLM(new).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(old)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", lambda self: None)
    llm.load_weights_from_disk(new)
    assert tokens_and_logprob_dicts(llm.generate(prompts, GREEDY, use_tqdm=False)) != expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_running_across_an_update_continue_under_the_new_weights(two_llamas, async_scheduling):
    """An update between steps: the tokens before it are the old weights', those after it the
    new weights' on the whole sequence. Under asynchronous scheduling the step in flight is
    processed first (its token is the old weights')."""
    old, new = two_llamas
    prompt = _prompts(5)[2]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(old, async_scheduling=async_scheduling)
    req = llm.engine.add_request("r", prompt, params)
    while len(req.output_token_ids) < 4:
        llm.engine.step()
    assert llm.engine.in_flight == async_scheduling
    llm.load_weights_from_disk(new)
    assert not llm.engine.in_flight
    early = list(req.output_token_ids)
    alone = LLM(old).generate(
        [prompt], SamplingParams(max_tokens=len(early), temperature=0.0, ignore_eos=True)
    )
    assert early == alone[0].outputs[0].token_ids
    while not req.finished:
        llm.engine.step()
    rest = LLM(new).generate(
        [prompt + early], SamplingParams(max_tokens=10 - len(early), temperature=0.0, ignore_eos=True)
    )
    assert req.output_token_ids == early + rest[0].outputs[0].token_ids
    assert llm.engine.make_output(req).weight_version == "1"


BAD_UPDATES = [
    ("model.layers.0.self_attn.q_proj.wieght", torch.zeros(1), ValueError, "not a parameter"),
    ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3), ValueError, "shape"),
    ("model.layers.0.self_attn.q_proj.weight", "zeros", TypeError, "torch.Tensor"),
    ("model.norm.weight", torch.zeros(256, dtype=torch.int32), ValueError, "dtype"),
    ("model.norm.weight", torch.full((256,), float("nan")), ValueError, "NaN"),
]


@pytest.mark.parametrize("name,value,error,match", BAD_UPDATES)
def test_a_bad_update_names_its_entry_and_changes_nothing(two_llamas, name, value, error, match):
    old, new = two_llamas
    prompts = _prompts(3)
    llm = LLM(old)
    before = tokens_and_logprob_dicts(llm.generate(prompts, GREEDY, use_tqdm=False))
    good = list(load_model(new).state_dict().items())  # valid entries first: none may land
    with pytest.raises(error, match=match):
        llm.update_weights([*good, (name, value)])
    assert llm.weight_version == "0"
    assert tokens_and_logprob_dicts(llm.generate(prompts, GREEDY, use_tqdm=False)) == before


def test_load_weights_from_disk_refuses_another_model(two_llamas, tmp_path):
    old, _ = two_llamas
    llm = LLM(old)
    with pytest.raises(ValueError, match="DeepseekV4"):
        llm.load_weights_from_disk(make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4"))
    extra = tmp_path / "extra"
    shutil.copytree(old, extra)
    state = dict(load_model(old).state_dict())
    state["model.extra.weight"] = torch.zeros(2)
    (extra / "model.safetensors").unlink()
    write_safetensors(state, extra)
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        llm.load_weights_from_disk(extra)
    assert llm.weight_version == "0"


def test_pause_lets_an_update_land_between_steps_of_another_thread(two_llamas):
    old, new = two_llamas
    prompts = _prompts(4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(old)
    outputs: list = []
    llm.pause_generation()
    worker = threading.Thread(target=lambda: outputs.extend(llm.generate(prompts, params, use_tqdm=False)))
    worker.start()
    assert llm.is_paused and not outputs
    llm.load_weights_from_disk(new)  # no step runs while paused
    llm.continue_generation()
    worker.join(timeout=120)
    assert [o.weight_version for o in outputs] == ["1"] * 3
    expected = LLM(new).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
