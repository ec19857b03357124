"""A replayed step's inputs go into the graph's static tensors in one copy per dtype: the step's
metadata and the static inputs are views of one buffer per dtype, laid out alike
(``to_device_together``), and ``copy_step_inputs`` copies whole buffers where they are."""

from __future__ import annotations

import torch
from capture_guard import META
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.cache.host_tensors import to_device_together
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.engine.graph_runner import DecodeGraphRunner, copy_step_inputs
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint

CPU = torch.device("cpu")


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 99, (4,), generator=gen),
        torch.rand(3, 2, generator=gen) > 0.5,
        torch.randint(0, 99, (2, 5), generator=gen),
        torch.randint(0, 99, (6,), generator=gen, dtype=torch.int32),
    ]


def test_alike_buffers_copy_once_per_dtype():
    static = to_device_together(_tensors(0), CPU)
    step = to_device_together(_tensors(1), CPU)
    copies = copy_step_inputs(list(zip(static, step, strict=True)))
    assert copies == 3  # long, bool, int32
    for d, s in zip(static, step, strict=True):
        assert torch.equal(d, s)


def test_unlike_layouts_copy_one_by_one():
    """Mutation check of the fast path's condition: sources packed in another order (each
    pair at a different offset) are copied tensor by tensor, and still right."""
    static = to_device_together(_tensors(0), CPU)
    values = _tensors(1)
    order = [2, 1, 0, 3]
    packed = to_device_together([values[i] for i in order], CPU)
    step = [packed[order.index(i)] for i in range(len(values))]
    copies = copy_step_inputs(list(zip(static, step, strict=True)))
    assert copies == 4
    for d, s in zip(static, step, strict=True):
        assert torch.equal(d, s)


class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _replay_copies(tmp_path, arch: str, clone: bool) -> tuple[int, int]:
    """(copies one replay makes, metadata tensors of the step) for a decode step of two
    sequences of ``arch``, on the meta device as on CUDA."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    model = load_model(path, device=META)
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    blocks, slots = 8, 4
    pools = allocate_pools(layout, blocks, slots, model.compute_dtype, META)
    runner = DecodeGraphRunner(model.step, layout, pools, blocks, slots, 256, slots, lambda fn: fn, META)
    runner.capture(2)
    chunks = [SeqChunk([0], 0, 5, 1, logits_offsets=[0]), SeqChunk([1], 1, 9, 1, logits_offsets=[0])]
    positions, batch = build_forward_batch(layout, pools, chunks, META, runner.padding(2))
    if clone:
        positions, batch = positions.clone(), batch.clone_metadata()
    ids = torch.zeros(2, dtype=torch.long, device=META)
    with _Copies() as copies:
        runner.run(2, ids, positions, batch)
    return copies.count, 1 + sum(1 for _ in batch.metadata())


def test_a_replay_copies_its_metadata_once_per_dtype(tmp_path):
    """Llama and V4 decode steps: the ids, then one copy per dtype (and the host-side span
    table alone), against one per tensor when the step's metadata is not packed."""
    for arch in ("llama", "deepseek_v4"):
        packed, tensors = _replay_copies(tmp_path, arch, clone=False)
        unpacked, _ = _replay_copies(tmp_path, arch, clone=True)
        assert packed <= 5, (arch, packed)
        assert unpacked == tensors + 1 > packed, (arch, unpacked, tensors)
