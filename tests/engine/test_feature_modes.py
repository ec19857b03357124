"""Every cell of the features x modes table (``deepinfer.feature_modes``): a feature that works
or falls back in a mode gives the eager engine's outputs there; a refused one raises the
table's reason before any weights load. The documentation's copy of the table is the table."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_adapters import hf_llama, make_adapter, random_lora_config
from rl_steps import train_step

from deepinfer import LLM, LoRARequest, SamplingParams, feature_modes
from deepinfer.engine import engine as engine_module
from deepinfer.engine import setup as engine_setup
from deepinfer.engine.cpu_decode import OneCallDecode
from deepinfer.feature_modes import FEATURES, MODES, TABLE, Support
from deepinfer.models.layers.lora import running_step
from deepinfer.models.loading import load_model
from deepinfer.platforms import GraphOutput, Platform
from deepinfer.platforms.cpu import replay_eagerly
from deepinfer.tiny import make_tiny_checkpoint

DOC = Path(__file__).resolve().parents[2] / "docs" / "guide" / "features-and-modes.md"
MIB = 1 << 20
EAGER = {"compile": False, "capture_graphs": False, "async_scheduling": False}
MODE_OPTIONS = {
    "compiled": {
        "compile": True,
        "compile_backend": "eager",
        "capture_graphs": False,
        "async_scheduling": False,
    },
    "graphs": {
        "compile": False,
        "capture_graphs": True,
        "max_graph_batch_size": 4,
        "async_scheduling": False,
    },
    "async": {"compile": False, "capture_graphs": False, "async_scheduling": True},
    "one_call": EAGER,
    "tp": {"tensor_parallel_size": 2},
    "dp": {"data_parallel_size": 2},
    "ep": {"enable_expert_parallel": True},
    "batch_invariant": {**EAGER, "batch_invariant": True},
}
FEATURE_OPTIONS = {
    "lora": {"enable_lora": True, "max_loras": 2},
    "kv_tiers": {"kv_offload_bytes": 64 * MIB},
    "speculative": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    },
    "routed_experts": {"enable_return_routed_experts": True},
    "rl_updates": {},
}
BASE = {"block_size": 8, "max_num_seqs": 4}


def replay_as_a_graph(fn: Callable[[], GraphOutput]) -> Callable[[], GraphOutput]:
    """``replay_eagerly``, where a replay sees none of the step's Python state (the running
    LoRA step), as a real graph replay would not: what the step reads must be its inputs."""
    replay = replay_eagerly(fn)

    def run() -> GraphOutput:
        with running_step(None):
            return replay()

    return run


GRAPHS = Platform("cpu-graphs", False, replay_as_a_graph, False)


def _cells(*supports: Support) -> list[tuple[str, str]]:
    return [(f, m) for f in FEATURES for m in MODES if TABLE[f][m].support in supports]


def test_the_table_covers_every_feature_and_mode():
    assert set(TABLE) == set(FEATURES) == set(FEATURE_OPTIONS)
    for feature, row in TABLE.items():
        assert set(row) == set(MODES) == set(MODE_OPTIONS), feature
        for mode, cell in row.items():
            if cell.support is Support.REFUSED:
                assert cell.note.startswith(("set ", "run ")), f"{feature}/{mode}: say what to change"
    # the one-call stack runs dense Llama layers only; routed experts exist in MoE models only
    assert _cells(Support.NOT_APPLICABLE) == [("routed_experts", "one_call")]


def test_the_documentation_prints_the_table():
    assert feature_modes.markdown() in DOC.read_text(), (
        "docs/guide/features-and-modes.md is stale: paste deepinfer.feature_modes.markdown() into it"
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fm_llama"), arch="llama", seed=4)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> list[LoRARequest]:
    base = hf_llama(llama)
    rng = random.Random(2)
    out = []
    for i in range(2):
        where = tmp_path_factory.mktemp(f"fm_ad{i}")
        config = random_lora_config(rng, ("q_proj", "v_proj", "down_proj"))
        make_adapter(base, where, config, seed=50 + i, b_scale=1.0)
        out.append(LoRARequest(f"ad{i}", i + 1, str(where)))
    return out


def _prompts(seed: int) -> list[list[int]]:
    """Six prompts: half share a long prefix (prefix hits), each ends in a repeated motif (drafts)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(20)]
    prompts = []
    for i in range(6):
        motif = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 5))]
        head = shared if i % 2 == 0 else [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
        prompts.append(head + motif * rng.randrange(3, 6))
    return prompts


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _outputs(outs) -> list:
    return [
        (o.outputs[0].token_ids, None if o.routed_experts is None else o.routed_experts.tolist())
        for o in outs
    ]


def _run(
    feature: str, options: dict, ckpt: Path, adapters: list[LoRARequest], workload: tuple[int, int, int]
) -> tuple[list, LLM]:
    """The feature's workload under ``options``: two rounds of prompts (the second reuses the
    first's prefixes; with RL updates a training step comes between them). ``workload``:
    the prompts' seed, the prefill chunk and the pool's blocks (small pools preempt)."""
    seed, chunk, blocks = workload
    kwargs = {**BASE, "max_num_batched_tokens": chunk, "num_cache_blocks": blocks, **FEATURE_OPTIONS[feature]}
    kwargs.update(options)
    if feature == "rl_updates":
        model = load_model(str(ckpt), requires_grad=True)
        llm = LLM.from_model(model, **kwargs)
    else:
        llm = LLM(str(ckpt), **kwargs)
    got = []
    for round_ in range(2):
        prompts = _prompts(seed + round_)
        extra = {}
        if feature == "lora":
            extra["lora_request"] = [adapters[i % 2] if i % 3 else None for i in range(len(prompts))]
        got += _outputs(llm.generate(prompts, PARAMS, use_tqdm=False, **extra))
        if feature == "rl_updates" and round_ == 0:
            train_step(model, seed=7, lr=0.05, length=16)
    return got, llm


def _in_mode(llm: LLM, mode: str) -> bool:
    """Whether the engine runs in ``mode`` (the check is not vacuous)."""
    engine = llm.engine
    return {
        "compiled": lambda: engine.runner.padding is not None,  # compiled steps are padded
        "graphs": lambda: engine.runner.graphs is not None and engine.runner.graphs.replays > 0,
        "async": lambda: engine.async_steps is not None,
        "one_call": lambda: isinstance(engine.runner.forward, OneCallDecode),
        "tp": lambda: engine.executor.tp is not None and engine.executor.tp.size == 2,
        "batch_invariant": lambda: engine.config.batch_invariant,
    }[mode]()


WORKLOADS = st.tuples(st.integers(0, 1000), st.sampled_from([32, 48]), st.sampled_from([14, 40]))


@pytest.mark.parametrize(("feature", "mode"), _cells(Support.WORKS, Support.FALLS_BACK))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=WORKLOADS)
def test_a_cell_that_runs_equals_the_eager_engine(
    feature, mode, llama, v4_short_ckpt, adapters, monkeypatch, workload
):
    ckpt = v4_short_ckpt if feature == "routed_experts" else llama
    with monkeypatch.context() as patched:
        patched.setattr(engine_setup, "one_call_decode", lambda model: None)  # the layer loop
        expected, _ = _run(feature, EAGER, ckpt, adapters, workload)
    with monkeypatch.context() as patched:
        if mode == "graphs":  # the layer loop, as on a GPU, "replayed" as eager calls
            patched.setattr(engine_setup, "one_call_decode", lambda model: None)
            patched.setattr(engine_module, "platform_for", lambda device: GRAPHS)
        torch._dynamo.reset()
        got, llm = _run(feature, MODE_OPTIONS[mode], ckpt, adapters, workload)
    try:
        assert got == expected
        if TABLE[feature][mode].support is Support.WORKS:
            assert _in_mode(llm, mode), f"{feature} did not run {mode}"
        elif mode == "async":  # the fallback: synchronous steps
            assert not _in_mode(llm, mode)
    finally:
        llm.close()  # a tensor-parallel engine's workers leave the group


@pytest.mark.parametrize(("feature", "mode"), _cells(Support.REFUSED))
def test_a_refused_cell_says_what_to_change(feature, mode, llama, v4_short_ckpt):
    ckpt = v4_short_ckpt if feature == "routed_experts" else llama
    error = feature_modes.refusal(feature, mode)
    assert error is not None
    kwargs = {**FEATURE_OPTIONS[feature], **MODE_OPTIONS[mode]}
    with pytest.raises(ValueError) as raised:
        if feature == "rl_updates":
            LLM.from_model(load_model(str(ckpt), requires_grad=True), **kwargs)
        else:
            LLM(str(ckpt), **kwargs)
    assert error in str(raised.value)
