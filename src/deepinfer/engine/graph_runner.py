"""Decode steps replayed from captured graphs (CUDA graphs; NPU graph mode), one graph per
batch-size bucket (docs/architecture.md, 'Compilation, passes and ops').

A captured graph replays fixed kernels on fixed addresses, so every tensor the step reads
lives in a *static* copy made at capture time, and a step only copies its values in before
replay. ``StepPadding`` with ``max_model_len`` gives every metadata tensor one shape per
bucket; the rows a step does not fill are null tokens that touch only the null block and
slot. Graphs are captured on a batch made only of null tokens, so the capture's warm-up runs
change no sequence's cache. Only pure-decode steps replay; anything else runs the compiled
(or eager) step: prefill chunks, speculative verify steps (several tokens per sequence) and
steps that return a model drafter's features never replay.

Two per-step inputs besides the metadata travel the same way: each row's adapter slot
(``ForwardBatch.lora_slots``; -1 for base rows and padding), which the projections hand to
``deepinfer::lora_add``, and the MoE layers' expert choices, which the captured step returns
as a second static output (``RoutingTrace``) instead of leaving them on a Python list that a
replay would never fill.

The recorded step is the compiled one, or with ``compile=False`` the eager step (graphs with
no Inductor compile at start). Either must read nothing on the host: the routed experts take
their grouped, sync-free kernels on CUDA (``kernels/moe.py``, ``kernels/quantized.py``), and
``tests/compile/test_capture_safety.py`` walks the eager step on the ``meta`` device.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools, RoutingTrace
from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.platforms import GraphCapture, GraphOutput

logger = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at ``max_batch``."""
    sizes, b = [], 1
    while b < min(max_batch, 8):
        sizes.append(b)
        b *= 2
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_batch)
    return sorted(set(sizes))


def measure_step_memory(
    model: torch.nn.Module,
    layout: CacheLayout,
    dtype: torch.dtype,
    device: torch.device,
    max_batch: int,
    max_model_len: int,
) -> int:
    """Peak bytes an eager decode step of ``max_batch`` null tokens allocates beyond what is
    already held (on CUDA; 0 elsewhere, where nothing is captured). Measured on throwaway
    one-block pools before the cache exists, so the cache budget can leave room for it."""
    if device.type != "cuda":
        return 0
    window = 1 if layout.bounded_window else None
    pools = allocate_pools(layout, 1, 1, dtype, device, window)
    positions, batch = build_forward_batch(
        layout, pools, [], device, StepPadding(1, 1, max_batch, max_model_len, null_window_block=window)
    )
    ids = torch.zeros(max_batch, dtype=torch.long, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model.step(ids, positions, batch)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


@dataclasses.dataclass
class _Captured:
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: ForwardBatch
    replay: Callable[[], GraphOutput]


class DecodeGraphRunner:
    def __init__(
        self,
        step: Step,
        layout: CacheLayout,
        pools: list[LayerPools],
        null_block: int,
        null_slot: int,
        max_model_len: int,
        max_batch: int,
        capture: GraphCapture,
        device: torch.device,
        null_window_block: int | None = None,
        lora: bool = False,
        record_routing: bool = False,
    ) -> None:
        """``lora``: steps carry each row's adapter slot; ``record_routing``: steps return the
        MoE layers' expert choices."""
        self.lora, self.record_routing = lora, record_routing
        self.step, self.layout, self.pools, self.device = step, layout, pools, device
        self.null_block, self.null_slot = null_block, null_slot
        self.null_window_block = null_window_block
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        self.capture_fn = capture
        self.graphs: dict[int, _Captured] = {}
        self.replays = 0

    def padding(self, bucket: int) -> StepPadding:
        return StepPadding(
            self.null_block,
            self.null_slot,
            bucket,
            self.max_model_len,
            null_window_block=self.null_window_block,
        )

    def bucket_for(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket a step replays in, or None when it must run uncaptured (a prefill
        chunk, a prefix-cache restore, CED replay, more sequences than the largest bucket)."""
        if not chunks or len(chunks) > self.buckets[-1]:
            return None
        if any(c.num_tokens != 1 or c.restore_overlap or c.replay_from > 0 for c in chunks):
            return None
        return next(b for b in self.buckets if b >= len(chunks))

    def capture(self, bucket: int) -> None:
        """Record the step for ``bucket`` on a batch of null tokens. Off the CPU the built
        batch is fresh device memory, one buffer per dtype (``to_device_together``), and is
        kept as the static inputs, laid out as every later step of the bucket is: a step's
        values then go in with one copy per dtype (``copy_step_inputs``)."""
        positions, batch = build_forward_batch(self.layout, self.pools, [], self.device, self.padding(bucket))
        ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
        if self.device.type == "cpu":  # host tensors the builder may share: copies of them
            positions, batch = positions.clone(), batch.clone_metadata()
        if self.lora:
            batch.lora_slots = torch.full((bucket,), -1, dtype=torch.long, device=self.device)

        def step() -> GraphOutput:
            if not self.record_routing:
                return self.step(ids, positions, batch)
            batch.routing = RoutingTrace()
            logits = self.step(ids, positions, batch)
            return logits, batch.routing.stacked()

        replay = self.capture_fn(step)
        self.graphs[bucket] = _Captured(ids, positions, batch, replay)

    def capture_all(self) -> None:
        for bucket in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its pool
            self.capture(bucket)
        logger.info("captured decode graphs for batch sizes %s", self.buckets)

    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        """Copy the step's values into the bucket's static tensors and replay its graph."""
        static = self.graphs.get(bucket)
        if static is None:
            raise RuntimeError(f"no graph captured for batch size {bucket}: call capture_all() first")
        static.input_ids.copy_(input_ids)
        pairs = [(static.positions, positions)]
        for (dst, _), (src, _) in zip(static.batch.metadata(), batch.metadata(), strict=True):
            if dst.shape != src.shape:
                raise RuntimeError(f"step metadata shape {tuple(src.shape)} != captured {tuple(dst.shape)}")
            pairs.append((dst, src))
        if static.batch.lora_slots is not None:
            if batch.lora_slots is None:  # no adapter row in this step
                static.batch.lora_slots.fill_(-1)
            else:
                pairs.append((static.batch.lora_slots, batch.lora_slots))
        copy_step_inputs(pairs)
        self.replays += 1
        out = static.replay()
        if isinstance(out, tuple):
            logits, routing = out
            if batch.routing is not None:  # read (and copied) before the next replay
                batch.routing.keep(routing)
            return logits.clone()
        return out.clone()


def copy_step_inputs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy each source into its static destination: where the destinations are views of one
    buffer and the sources views of another laid out alike (same size, each pair at the same
    offset), the whole buffer in one copy; the rest one by one. A step's metadata is dozens
    of small tensors, and each copy is a launch. Returns the copies made."""
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    alone: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if dst._base is None or src._base is None:
            alone.append((dst, src))
        else:
            groups.setdefault((id(dst._base), id(src._base)), []).append((dst, src))
    copies = 0
    for members in groups.values():
        dst_base, src_base = members[0][0]._base, members[0][1]._base
        assert dst_base is not None and src_base is not None
        alike = (
            dst_base.shape == src_base.shape
            and dst_base.dtype == src_base.dtype
            and all(d.storage_offset() == s.storage_offset() for d, s in members)
        )
        if alike:
            dst_base.copy_(src_base)
            copies += 1
        else:
            alone += members
    for dst, src in alone:
        dst.copy_(src)
        copies += 1
    return copies
