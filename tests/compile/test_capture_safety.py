"""CUDA-graph capture rules, checked on the CPU (``capture_guard``): the decode step every
captured graph records makes no host sync and copies no host data in, for every model, weight
format and option that changes the step (the guard walks the eager step, the one
``compile=False, capture_graphs=True`` captures, and the ops' own code for the ``meta``
device: the routed experts' grouped forms); the step's metadata is built without reading
device values; sampling penalties stay on the logits' device; the MoE fusion's constant lands
on the experts' device. The guard itself is shown to catch each kind of violation, and the
experts' host-read loops. Speculative steps never replay from graphs (verify steps have
several tokens per sequence, model-drafter steps return features): the engine checks show
that, and the captured step of models with draft layers is checked like any other.
"""

from __future__ import annotations

import pytest
import torch
from capture_guard import META, CaptureGuard, guarded_capture
from deepinfer.kernels.moe import routed_experts
from deepinfer.kernels.quantized import routed_experts_fp4

from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.engine.graph_runner import DecodeGraphRunner
from deepinfer.models.layers.quantized_linear import Fp8BlockLinear
from deepinfer.models.loading import load_model
from deepinfer.sampling.sampler import SamplingRow, apply_processors
from deepinfer.sampling_params import SamplingParams
from deepinfer.tiny import make_tiny_checkpoint


def _item(x):
    return x * x.sum().item()


def _nonzero(x):
    return x[torch.nonzero(x > 0).squeeze(1)]


def _branch(x):
    return x if bool((x > 0).any()) else -x


def _constant_table(x):
    return x * torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)


_HOST_TABLE = torch.arange(4.0)


def _copy_each_call(x):
    return x * _HOST_TABLE.to(x.device)


def _mixed(x):
    return x + _HOST_TABLE


@pytest.mark.parametrize("broken", [_item, _nonzero, _branch, _constant_table, _copy_each_call, _mixed])
def test_guard_catches_each_violation(broken):
    """Mutation check: each way a step can break capture is reported, with its line."""
    x = torch.ones(4, device=META)
    with pytest.raises(AssertionError, match="test_capture_safety.py"):
        guarded_capture(lambda: broken(x))


def test_guard_passes_clean_code():
    x = torch.ones(4, device=META)
    scale = torch.tensor(2.0)  # a 0-d host scalar is an argument capture allows
    guarded_capture(lambda: (x * scale).softmax(0)[torch.arange(2, device=META)])


CASES = [
    pytest.param("llama", {}, {}, id="llama"),
    pytest.param("deepseek_v4", {}, {"fake_quant": False}, id="v4"),
    pytest.param("deepseek_v4", {}, {"fake_quant": True}, id="v4-fake-quant"),
    pytest.param("deepseek_v4", {}, {"dtype": torch.bfloat16}, id="v4-bf16"),  # torch._grouped_mm
    pytest.param("deepseek_v41", {}, {}, id="v41"),
    # the release format kept resident: fp8 block linears and fp4 routed experts
    pytest.param(
        "deepseek_v4", {"quant": "fp8"}, {"keep_quantized": True, "dtype": torch.bfloat16}, id="v4-fp8-fp4"
    ),
    pytest.param("deepseek_v41", {"quant": "fp8"}, {"keep_quantized": True}, id="v41-fp8-fp4"),
    # quantization="fp8" of a float checkpoint: fp8 block linears, float experts
    pytest.param("deepseek_v4", {}, {"quantize_fp8": True}, id="v4-fp8-on-load"),
]


def _meta_model(tmp_path, arch: str, ckpt_kw: dict, load_kw: dict):
    """A tiny checkpoint's model on the value-less meta device, in the case's weight format."""
    load_kw = dict(load_kw)
    quantize_fp8 = load_kw.pop("quantize_fp8", False)
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, **ckpt_kw)
    model = load_model(path, device=META, **load_kw)
    if quantize_fp8:
        model.quantize_fp8((32, 32))
    return model


def _meta_runner(model, **options) -> DecodeGraphRunner:
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    blocks, slots = 8, 4
    pools = allocate_pools(layout, blocks, slots, model.compute_dtype, META)
    return DecodeGraphRunner(
        model.step, layout, pools, blocks, slots, 256, slots, guarded_capture, META, **options
    )


@pytest.mark.parametrize(("arch", "ckpt_kw", "load_kw"), CASES)
def test_every_decode_bucket_is_capturable(arch, ckpt_kw, load_kw, tmp_path):
    """The graph runner captures each bucket with a backend that enforces capture's rules,
    on a model and cache that live on the value-less meta device."""
    model = _meta_model(tmp_path, arch, ckpt_kw, load_kw)
    quantized = ckpt_kw.get("quant") == "fp8" or load_kw.get("quantize_fp8")
    assert any(isinstance(m, Fp8BlockLinear) for m in model.modules()) == bool(quantized)
    assert any(getattr(m, "holds_fp4", False) for m in model.modules()) == bool(load_kw.get("keep_quantized"))
    runner = _meta_runner(model)
    runner.capture_all()
    assert sorted(runner.graphs) == [1, 2, 4]


@pytest.mark.parametrize(
    ("op", "arch", "ckpt_kw", "load_kw", "where"),
    [
        (
            routed_experts_fp4,
            "deepseek_v4",
            {"quant": "fp8"},
            {"keep_quantized": True},
            "kernels/quantized.py",
        ),
        (routed_experts, "deepseek_v4", {}, {}, "kernels/moe.py"),
    ],
    ids=["fp4", "float"],
)
def test_capture_reports_the_host_read_expert_loops(op, arch, ckpt_kw, load_kw, where, tmp_path):
    """Mutation check: with the op's grouped ``meta`` kernel off, its default (the CPU's
    loop over the experts that got tokens, counted on the host) runs and fails capture,
    named at its line."""
    runner = _meta_runner(_meta_model(tmp_path, arch, ckpt_kw, load_kw))
    with (
        op.set_kernel_enabled("meta", False),
        pytest.raises(AssertionError, match=rf"bincount\S* at \S*{where}"),
    ):
        runner.capture(1)


@pytest.mark.parametrize(("arch", "method"), [("deepseek_v4", "mtp"), ("deepseek_v41", "dspark")])
def test_decode_step_of_a_model_with_draft_layers_is_capturable(arch, method, tmp_path):
    """What graphs replay for a model that carries a drafter's layers: its plain decode step,
    with no draft features asked for (a step that returns them never replays)."""
    model = _meta_model(tmp_path, arch, {}, {})
    assert model.draft_model(method) is not None
    runner = _meta_runner(model)
    runner.capture_all()
    assert all(g.batch.feature_idx is None for g in runner.graphs.values())


def test_decode_steps_with_adapter_slots_or_a_routing_trace_are_capturable(tmp_path):
    """Served adapters (each row's slot a static input, ``deepinfer::lora_add``'s default
    form) and the routing record (a second static output) keep every bucket capturable."""
    from deepinfer.lora.targets import find_targets, stack_for

    llama = _meta_model(tmp_path, "llama", {}, {})
    stacks = [stack_for(t, 2, 8, llama.compute_dtype, META) for t in find_targets(llama).values()]
    assert stacks and all(t.kind == "projection" for t in find_targets(llama).values())
    runner = _meta_runner(llama, lora=True)
    runner.capture_all()
    assert all(g.batch.lora_slots is not None for g in runner.graphs.values())
    v4 = _meta_runner(_meta_model(tmp_path, "deepseek_v4", {}, {}), record_routing=True)
    v4.capture_all()
    assert all(isinstance(g.replay(), tuple) for g in v4.graphs.values())


def test_step_metadata_is_built_on_the_host():
    """``build_forward_batch`` for the device reads no device value (it computes on the
    host and copies each index tensor once)."""
    specs = [  # a CSA-like layer: ratio 4 with overlap and indexer keys
        LayerCacheSpec(
            window=8, kv_dim=8, ratio=4, overlap=True, compressor_width=8, index_dim=4, index_width=4
        )
    ]
    layout = CacheLayout.from_specs(specs, 16)
    pools = allocate_pools(layout, 8, 4, torch.float32, META)
    chunks = [SeqChunk([0, 1], 0, 3, 9, logits_offsets=[8]), SeqChunk([2], 1, 5, 1, logits_offsets=[0])]
    with CaptureGuard() as found:
        build_forward_batch(layout, pools, chunks, META, StepPadding.for_pools(8, 4))
    host_reads = [f for f in found if "device sync" in f or "host read" in f]
    assert not host_reads, host_reads


def test_penalties_stay_on_the_logits_device():
    logits = torch.zeros(2, 16, device=META)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    rows = [SamplingRow(params, None, [1, 2], [3, 3, 4], [0]) for _ in range(2)]
    with CaptureGuard() as found:
        out = apply_processors(logits, rows)
    assert out.device == META
    assert not [f for f in found if "reads a host tensor" in f], found


def _graph_platform(monkeypatch, compile_by_default: bool = False) -> list[int]:
    """The engine's platform swapped for one whose graph backend replays eagerly and records
    each capture (the CPU platform has no graph mode); returns the record."""
    from deepinfer.engine import engine as engine_module
    from deepinfer.platforms import Platform
    from deepinfer.platforms.cpu import replay_eagerly

    captured: list[int] = []

    def recording_capture(fn):
        captured.append(1)
        return replay_eagerly(fn)

    platform = Platform("cpu-graphs", compile_by_default, recording_capture, False)
    monkeypatch.setattr(engine_module, "platform_for", lambda device: platform)
    return captured


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_engine_captures_every_bucket_before_its_first_step(tmp_path, monkeypatch):
    """Capture happens at engine start on the engine's thread, never lazily on the
    asynchronous worker while the main thread prepares the next step."""
    from deepinfer import LLM

    captured = _graph_platform(monkeypatch)
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    llm = LLM(path, capture_graphs=True, max_num_seqs=8, async_scheduling=True)
    runner = llm.engine.runner.graphs
    assert sorted(runner.graphs) == runner.buckets == [1, 2, 4, 8]
    assert len(captured) == 4
    outs = llm.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(captured) == 4 and runner.replays > 0  # no capture after start
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    with pytest.raises(RuntimeError, match="no graph captured"):
        runner.run(16, *[None] * 3)


def test_execution_modes_take_graphs_without_inductor():
    """``compile=False, capture_graphs=True`` on a platform that compiles by default (as
    CUDA does): graphs over the eager step; a platform with no graph mode refuses it."""
    from deepinfer.config import EngineConfig
    from deepinfer.engine.setup import execution_modes
    from deepinfer.platforms import Platform
    from deepinfer.platforms.cpu import replay_eagerly

    cuda_like = Platform("cuda-like", True, replay_eagerly, True)
    config = EngineConfig(compile=False, capture_graphs=True)
    config.validate()
    modes = execution_modes(config, None, cuda_like, None)
    assert (modes.compile, modes.graphs) == (False, True)
    default = execution_modes(EngineConfig(), None, cuda_like, None)
    assert (default.compile, default.graphs) == (True, True)
    no_graphs = Platform("no-graphs", True, None, False)
    with pytest.raises(ValueError, match="no-graphs platform has no graph mode"):
        execution_modes(config, None, no_graphs, None)


def test_graphs_without_inductor_replay_the_eager_step(tmp_path, monkeypatch):
    """The engine on a platform that compiles by default, told ``compile=False,
    capture_graphs=True``: nothing is compiled, every bucket is captured at start over the
    eager step, decode steps replay, and the tokens are the eager engine's."""
    from deepinfer import LLM

    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    prompts = [[3, 4, 5], [6, 7], list(range(10, 30))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = _tokens(LLM(path, compile=False, max_num_seqs=4).generate(prompts, params, use_tqdm=False))
    captured = _graph_platform(monkeypatch, compile_by_default=True)

    def no_compile(*args, **kwargs):
        raise AssertionError("compile=False compiled the step")

    monkeypatch.setattr(torch, "compile", no_compile)
    llm = LLM(path, compile=False, capture_graphs=True, max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    assert len(captured) == len(graphs.buckets) == 3
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert graphs.replays > 0 and len(captured) == 3


def test_speculative_verify_steps_run_uncaptured(tmp_path, monkeypatch):
    """Graphs replay single-token decode steps only: with n-gram drafting, every step that
    verifies drafts (several tokens per sequence) runs uncaptured, plain decodes replay, and
    the tokens equal those of the same engine without graphs."""
    from deepinfer import LLM

    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9] * 5, [11, 12]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    plain = _tokens(
        LLM(path, speculative_config=spec, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    )
    _graph_platform(monkeypatch)
    llm = LLM(path, speculative_config=spec, compile=False, capture_graphs=True, max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    steps: list[tuple[int, int | None]] = []
    bucket_for = graphs.bucket_for

    def recording(chunks):
        bucket = bucket_for(chunks)
        steps.append((max((c.num_tokens for c in chunks), default=0), bucket))
        return bucket

    monkeypatch.setattr(graphs, "bucket_for", recording)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    assert llm.engine.spec is not None and llm.engine.spec.stats.verify_steps > 0
    assert all(bucket is None for tokens, bucket in steps if tokens > 1)
    assert graphs.replays == sum(bucket is not None for _, bucket in steps) > 0


def test_model_drafter_steps_never_replay(tmp_path, monkeypatch):
    """With an MTP drafter every step returns the draft features the drafter reads, so no
    step could replay a graph: none is captured, and the tokens equal the engine's without
    graphs."""
    from deepinfer import LLM

    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4")
    prompts = [[3, 4, 5, 6], [7, 8]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    kw = {"speculative_config": spec, "max_num_seqs": 2, "compile": False}
    plain = _tokens(LLM(path, **kw).generate(prompts, params, use_tqdm=False))
    captured = _graph_platform(monkeypatch)
    llm = LLM(path, capture_graphs=True, **kw)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    assert not captured and llm.engine.runner.graphs is None
