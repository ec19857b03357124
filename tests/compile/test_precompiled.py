"""Compiled steps saved to disk and loaded by a fresh process (precompiled.py): the loaded step
gives the eager engine's tokens and compiles nothing; artefacts are keyed by what changes the
compiled code; a damaged artefact is skipped, never fatal.

One real compile of a 2-layer tiny V4 (the module's slow part) serves the whole module. It is the
suite's end-to-end check of the CPU's production setting, the C++ wrapper, which conftest.py
turns off for the other compiling tests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.compile import precompiled
from deepinfer.compile.compilation import CPP_WRAPPER_ENV, CPU_MIN_CHUNK_SIZE, PassManager, inductor_options
from deepinfer.compile.precompiled import PrecompiledStep, artefact_key, default_cache_dir
from deepinfer.models.loading import load_model
from deepinfer.platforms import cpu_blas
from deepinfer.tiny import make_tiny_checkpoint

_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys, time
    start = time.perf_counter()
    import torch
    torch.set_num_threads(int(sys.argv[3]))  # dynamo's global-state guard holds the count
    from torch.profiler import profile
    from deepinfer import LLM, SamplingParams
    from deepinfer.kernels.cpu import linear_op as cpu_linear_op
    prompts = json.loads(sys.argv[2])
    llm = LLM(sys.argv[1], compile=True, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    packed = cpu_linear_op.packed_calls()
    with profile() as prof:  # the dispatcher records every op it calls; C shims bypass it
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ours = ("packed_linear", "routed_experts_cpu", "sinkhorn_cpu", "indexer_topk_cpu", "rope_cpu",
            "sink_attention_rows_cpu")
    dispatched = sum(e.count for e in prof.key_averages() if e.key in [f"deepinfer::{o}" for o in ours])
    step = llm.engine.runner.forward
    print(json.dumps({"tokens": tokens, "loaded": step.loaded, "compiled": step.compiled,
                      "scalar_args_cached": step.scalar_args_cached, "plain_helpers": step.plain_helpers,
                      "packed_calls": cpu_linear_op.packed_calls() - packed, "dispatched": dispatched,
                      "seconds": time.perf_counter() - start}))
    """
)


def _prompts() -> list[list[int]]:
    """Short and long prompts: the indexer's top-k covers all of a short prompt's entries and
    a subset of a long one's, so the workload needs more than one compiled variant."""
    rng = random.Random(0)
    return [[rng.randrange(2, 258) for _ in range(n)] for n in (3, 9, 40, 70)]


@pytest.fixture(scope="module", autouse=True)
def cpp_wrapper():
    """The production default (C++ wrapper) for this module and the processes it starts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CPP_WRAPPER_ENV, "1")
        yield


@pytest.fixture(scope="module", autouse=True)
def production_threads():
    """Two compute threads, as the CPU engine runs on a machine with two cores (conftest
    gives xdist workers one): the variants are built for two, and small steps run them on one
    (``cpu_blas.openmp_for_step``), so with two threads the tokens checks below cover
    kernels built for two threads run on one (where the CPU count differs, Inductor names the
    count in its kernels and only ATen's and our loops switch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pre"), arch="deepseek_v4", num_hidden_layers=2)


PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def compiled(checkpoint) -> tuple[list[list[int]], list[Path]]:
    """The eager engine's tokens, then one ``compile=True`` run that compiles and saves the
    step's variants (checked here): (eager tokens, saved variant paths)."""
    eager = _tokens(LLM(checkpoint))
    llm = LLM(checkpoint, compile=True, max_num_batched_tokens=64)
    first = _tokens(llm)
    step = llm.engine.runner.forward
    assert isinstance(step, PrecompiledStep)
    assert first == eager
    saved = step.variant_paths()
    assert step.loaded == 0 and step.compiled == len(saved) >= 1
    # the C++ wrapper's entry of every variant takes its scalar arguments from a cache
    assert step.scalar_args_cached == step.compiled
    # and its pregraph bytecode reads sizes through the helpers' bodies (pregraph_calls.py)
    assert step.plain_helpers == step.compiled
    assert all(p.parent == checkpoint / ".deepinfer-compiled" for p in saved)
    # written under a temporary name, then renamed: nothing half-written is left beside them
    assert sorted((checkpoint / ".deepinfer-compiled").iterdir()) == sorted(saved)
    return eager, saved


def test_a_fresh_process_loads_the_saved_variants_and_compiles_nothing(checkpoint, compiled):
    eager, saved = compiled
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_PROCESS,
            str(checkpoint),
            json.dumps(_prompts()),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    fresh = json.loads(run.stdout.strip().splitlines()[-1])
    assert fresh["tokens"] == eager
    assert fresh["loaded"] == len(saved) and fresh["compiled"] == 0
    assert fresh["scalar_args_cached"] == len(saved)  # loaded variants too; tokens as eager
    assert fresh["plain_helpers"] == len(saved)
    # the loaded C++ wrappers found our ops' C shims and called them, never the dispatcher
    assert fresh["packed_calls"] > 0 and fresh["dispatched"] == 0


def test_the_cpu_default_runs_a_saved_step_and_never_compiles(checkpoint, compiled, tmp_path):
    """``compile=None`` on the CPU, with ``cpu_compile_after_s=None``: V4 runs the variants an
    earlier run saved; a step none of them covers runs eagerly instead of compiling; with
    nothing saved the step is eager."""
    eager, saved = compiled
    llm = LLM(checkpoint, max_num_batched_tokens=64, cpu_compile_after_s=None)
    step = llm.engine.runner.forward
    assert isinstance(step, PrecompiledStep) and not step.compile_missing
    assert _tokens(llm) == eager
    assert step.loaded == len(saved) and step.compiled == 0 and step.eager_steps == 0
    step._variants = []  # as if no saved guard accepted the steps
    assert _tokens(llm) == eager
    assert step.compiled == 0 and step.eager_steps > 0
    nothing_saved = LLM(checkpoint, compile_cache_dir=str(tmp_path / "empty"), cpu_compile_after_s=None)
    assert not isinstance(nothing_saved.engine.runner.forward, PrecompiledStep)
    invariant = LLM(checkpoint, batch_invariant=True)  # eager steps by definition
    assert not isinstance(invariant.engine.runner.forward, PrecompiledStep)
    assert not isinstance(LLM(checkpoint, compile=False).engine.runner.forward, PrecompiledStep)


def test_the_cpu_default_keeps_llama_eager_even_with_a_saved_step(tmp_path):
    """Llama's eager CPU step (one C++ call) beats its compiled one: ``compile=None`` never
    picks a saved step for it; ``compile=True`` still does."""
    llama = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    step = PrecompiledStep(load_model(llama), llama / ".deepinfer-compiled")
    step.cache_dir.mkdir()
    (step.cache_dir / f"{step.key}-0.step").write_bytes(b"a saved variant")
    assert step.has_saved_variants()
    assert not isinstance(LLM(llama).engine.runner.forward, PrecompiledStep)


class _RecordingVariant:
    """Stands in for a loaded variant: accepts every step, records the thread count its guard
    check and its call saw, and returns a marker instead of logits."""

    def __init__(self) -> None:
        self.guards: list[int] = []
        self.calls: list[tuple[int, int]] = []

    def guard_check(self, model, input_ids, positions, batch) -> bool:
        self.guards.append(torch.get_num_threads())
        return True

    def __call__(self, model, input_ids, positions, batch) -> str:
        self.calls.append((input_ids.shape[0], torch.get_num_threads()))
        if batch == "fail":
            raise RuntimeError("a failing step")
        return "logits"


@pytest.mark.skipif(not cpu_blas.openmp_available(), reason="PyTorch's OpenMP runtime not found")
def test_a_small_step_runs_its_variant_on_one_thread_after_its_guards(checkpoint, tmp_path):
    """Guards are checked at the process's thread count (dynamo's guards record it); a step of
    at most ``OPENMP_SINGLE_THREAD_ROWS`` rows then runs on one OpenMP thread, a larger one on all;
    the count is back after each call, a failing one included."""
    step = PrecompiledStep(load_model(checkpoint), tmp_path)
    variant = _RecordingVariant()
    step._variants = [variant]
    small = torch.zeros(cpu_blas.OPENMP_SINGLE_THREAD_ROWS, dtype=torch.long)
    large = torch.zeros(cpu_blas.OPENMP_SINGLE_THREAD_ROWS + 1, dtype=torch.long)
    assert step(small, small, None) == "logits" and torch.get_num_threads() == 2
    assert step(large, large, None) == "logits" and torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="failing"):
        step(small, small, "fail")
    assert torch.get_num_threads() == 2
    assert variant.guards == [2, 2, 2]
    assert variant.calls == [(small.shape[0], 1), (large.shape[0], 2), (small.shape[0], 1)]


def test_a_damaged_artefact_is_skipped(checkpoint, caplog):
    model = load_model(checkpoint)
    step = PrecompiledStep(model, checkpoint / "damaged")
    step.cache_dir.mkdir()
    (step.cache_dir / f"{step.key}-0.step").write_bytes(b"not an artefact")
    with caplog.at_level("WARNING", logger="deepinfer.compile.precompiled"):
        assert step._load() == []
    assert step.loaded == 0 and "unusable" in caplog.text


def test_artefact_key_follows_config_dtype_and_passes(checkpoint, tmp_path):
    def pass_a(graph: torch.fx.Graph) -> int:
        return 0

    model = load_model(checkpoint)
    same = load_model(checkpoint)
    manager = PassManager([])
    assert artefact_key(model, manager) == artefact_key(same, manager)
    assert artefact_key(model, manager) != artefact_key(model, PassManager([pass_a]))
    assert artefact_key(model, manager) != artefact_key(load_model(checkpoint, dtype=torch.bfloat16), manager)
    other = make_tiny_checkpoint(tmp_path / "three", arch="deepseek_v4", num_hidden_layers=3)
    assert artefact_key(model, manager) != artefact_key(load_model(other), manager)


def test_the_cpp_wrapper_switch_reaches_the_options_and_the_key(checkpoint, monkeypatch):
    """A step compiled with the Python wrapper is other code: its artefact has another key."""
    model, manager = load_model(checkpoint), PassManager([])
    cpu = torch.device("cpu")
    assert inductor_options(manager, cpu)["cpp_wrapper"] is True
    assert inductor_options(manager, cpu)["cpp.min_chunk_size"] == CPU_MIN_CHUNK_SIZE
    shims = inductor_options(manager, cpu)["aot_inductor.custom_ops_to_c_shims"]
    assert set(shims) == {
        torch.ops.deepinfer.packed_linear.default,
        torch.ops.deepinfer.routed_experts_cpu.default,
        torch.ops.deepinfer.sinkhorn_cpu.default,
        torch.ops.deepinfer.indexer_topk_cpu.default,
        torch.ops.deepinfer.rope_cpu.default,
        torch.ops.deepinfer.sink_attention_rows_cpu.default,
    }
    assert "cpp.min_chunk_size" not in inductor_options(manager, torch.device("meta"))
    with_wrapper = artefact_key(model, manager)
    monkeypatch.setenv(CPP_WRAPPER_ENV, "0")
    assert "cpp_wrapper" not in inductor_options(manager, cpu)
    assert "aot_inductor.custom_ops_to_c_shims" not in inductor_options(manager, cpu)
    assert artefact_key(model, manager) != with_wrapper
    monkeypatch.setenv(CPP_WRAPPER_ENV, "maybe")
    with pytest.raises(ValueError, match=CPP_WRAPPER_ENV):
        inductor_options(manager, cpu)


def test_default_cache_dir_is_beside_a_writable_checkpoint(tmp_path, monkeypatch):
    assert default_cache_dir(tmp_path) == tmp_path / ".deepinfer-compiled"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert default_cache_dir(tmp_path) == tmp_path / "xdg" / "deepinfer" / "compiled"
    assert default_cache_dir(None) == tmp_path / "xdg" / "deepinfer" / "compiled"


class _FakeVariant:
    """Stands in for a compiled variant (the real compile is tested above): accepts every
    step and runs it eagerly, so the rule's timing is tested without a 30 s compile."""

    def __init__(self, model) -> None:
        self.model = model

    def guard_check(self, *args) -> bool:
        return True

    def __call__(self, model, input_ids, positions, batch):
        return model.step(input_ids, positions, batch)


class _StepClock:
    """``precompiled``'s clock: every eager step takes exactly one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0  # a step's two reads are one second apart
        return self.now


def test_the_cpu_default_compiles_once_eager_steps_cost_a_compile(
    checkpoint, compiled, tmp_path, monkeypatch
):
    """Ski rental: with nothing saved, steps run eagerly while their time stays under
    ``cpu_compile_after_s``; the first step after it is spent compiles, and later steps run
    the variant; the eager count restarts after the compile."""
    eager, _ = compiled
    at_compile: list[tuple[float, int]] = []

    def fake_compile(self, args, index):
        assert self._padded  # the step to compile was prepared with padded metadata
        at_compile.append((self.eager_seconds, self.eager_steps))
        self.compiled += 1
        return _FakeVariant(self.model)

    monkeypatch.setattr(PrecompiledStep, "_compile", fake_compile)
    monkeypatch.setattr(precompiled, "time", _StepClock())
    llm = LLM(
        checkpoint, max_num_batched_tokens=64, compile_cache_dir=str(tmp_path / "c"), cpu_compile_after_s=3
    )
    step = llm.engine.runner.forward
    assert isinstance(step, PrecompiledStep) and not step.compile_missing and step.compile_after_s == 3
    assert _tokens(llm) == eager
    assert at_compile == [(3.0, 3)]  # three eager seconds, then the fourth step compiled
    assert step.compiled == 1 and step.eager_steps == 3 and step.eager_seconds == 0.0
    # a budget the run never spends: every step eager, nothing compiled
    never = LLM(
        checkpoint, max_num_batched_tokens=64, compile_cache_dir=str(tmp_path / "d"), cpu_compile_after_s=1e9
    )
    assert _tokens(never) == eager
    forward = never.engine.runner.forward
    assert forward.compiled == 0 and forward.eager_steps > 3 and forward.eager_seconds == forward.eager_steps
    assert not forward.needs_padding()  # eager steps are prepared unpadded (faster)
    assert never.engine.runner._step_padding() is None and llm.engine.runner._step_padding() is not None
    # budget 0: the first uncovered step compiles at once
    at_once = LLM(
        checkpoint, max_num_batched_tokens=64, compile_cache_dir=str(tmp_path / "e"), cpu_compile_after_s=0
    )
    assert _tokens(at_once) == eager
    assert at_once.engine.runner.forward.eager_steps == 0 and at_once.engine.runner.forward.compiled == 1


def test_cpu_compile_after_s_is_validated(checkpoint, monkeypatch):
    from deepinfer.config import COMPILE_AFTER_ENV, EngineConfig

    for bad in (-1.0, "30", True):
        with pytest.raises(ValueError, match="cpu_compile_after_s"):
            EngineConfig(cpu_compile_after_s=bad).validate()
    monkeypatch.setenv(COMPILE_AFTER_ENV, "12.5")
    assert EngineConfig().cpu_compile_after_s == 12.5
    monkeypatch.setenv(COMPILE_AFTER_ENV, "none")
    assert EngineConfig().cpu_compile_after_s is None
    monkeypatch.setenv(COMPILE_AFTER_ENV, "soon")
    with pytest.raises(ValueError, match=COMPILE_AFTER_ENV):
        EngineConfig()
    monkeypatch.delenv(COMPILE_AFTER_ENV)
    assert EngineConfig().cpu_compile_after_s == 30.0


def _tag_safe_roots(node) -> int:
    """Guard managers in the tree whose subtree a matching dict tag skips."""
    from torch._C._dynamo.guards import DictGuardManager

    if node is None:
        return 0
    if isinstance(node, DictGuardManager):
        children = [m for pair in node.get_key_value_managers().values() for m in pair]
    else:
        children = node.get_child_managers()
    return int(node.is_tag_safe_root()) + sum(_tag_safe_roots(c) for c in children)


def test_loaded_guards_skip_unchanged_modules_yet_reject_a_replaced_parameter(checkpoint, compiled):
    """The loaded guard trees skip the model's module subtrees by dict tag; a parameter
    replaced with one of another shape changes a dict, so every variant rejects the step."""
    eager, _ = compiled
    llm = LLM(checkpoint, compile=True, max_num_batched_tokens=64)
    step = llm.engine.runner.forward
    seen: list[tuple] = []
    run = step._run
    step._run = lambda index, args: seen.append(args) or run(index, args)
    assert _tokens(llm) == eager
    assert step.loaded >= 1 and step.compiled == 0
    assert all(_tag_safe_roots(v._artifacts.guard_manager.root) > 0 for v in step._variants)
    args = seen[-1]
    with torch.inference_mode():
        assert any(v.guard_check(*args) for v in step._variants)
        wkv = llm.engine.runner.model.layers[0].attn.wkv
        kept = wkv.weight
        wkv.weight = torch.nn.Parameter(torch.zeros(kept.shape[0] + 1, kept.shape[1]), requires_grad=False)
        assert not any(v.guard_check(*args) for v in step._variants)
        wkv.weight = kept
        assert any(v.guard_check(*args) for v in step._variants)
