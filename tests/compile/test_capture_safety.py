"""CUDA-graph capture rules, checked on the CPU (``capture_guard``): the decode step every
captured graph records makes no host sync and copies no host data in, for every model and
option that changes the step; the step's metadata is built without reading device values;
sampling penalties stay on the logits' device; the MoE fusion's constant lands on the
experts' device. The guard itself is shown to catch each kind of violation."""

from __future__ import annotations

import pytest
import torch
from capture_guard import META, CaptureGuard, guarded_capture

from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.engine.graph_runner import DecodeGraphRunner
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
    ("llama", {}),
    ("deepseek_v4", {"fake_quant": False}),
    ("deepseek_v4", {"fake_quant": True}),
    ("deepseek_v41", {}),
]


@pytest.mark.parametrize(("arch", "load_kw"), CASES)
def test_every_decode_bucket_is_capturable(arch, load_kw, tmp_path):
    """The graph runner captures each bucket with a backend that enforces capture's rules,
    on a model and cache that live on the value-less meta device."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    model = load_model(path, device=META, **load_kw)
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    blocks, slots = 8, 4
    pools = allocate_pools(layout, blocks, slots, model.compute_dtype, META)
    runner = DecodeGraphRunner(model.step, layout, pools, blocks, slots, 256, slots, guarded_capture, META)
    runner.capture_all()
    assert sorted(runner.graphs) == [1, 2, 4]


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


def test_engine_captures_every_bucket_before_its_first_step(tmp_path, monkeypatch):
    """Capture happens at engine start on the engine's thread, never lazily on the
    asynchronous worker while the main thread prepares the next step."""
    from deepinfer import LLM
    from deepinfer.engine import engine as engine_module
    from deepinfer.platforms import Platform
    from deepinfer.platforms.cpu import replay_eagerly

    captured: list[int] = []

    def recording_capture(fn):
        captured.append(1)
        return replay_eagerly(fn)

    platform = Platform("cpu-graphs", False, recording_capture, False)
    monkeypatch.setattr(engine_module, "platform_for", lambda device: platform)
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
