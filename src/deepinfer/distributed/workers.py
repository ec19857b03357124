"""Worker processes of a tensor- or expert-parallel engine: one per extra rank, started by rank 0's
engine (``torch.multiprocessing``, spawn), joined in one ``torch.distributed`` group (gloo on
the CPU; NCCL on CUDA, untested). Rank 0 schedules; before each step it broadcasts the step's
chunks and input ids, every rank builds the same step metadata over its own cache pools and
runs its share of the model, and the layers' all-reduces keep the ranks in lockstep. A
worker that dies shows up as a failed collective on rank 0, which then names the dead rank
(``TensorParallelGroup.checked``); one that hangs, after ``TIMEOUT_S``. Across machines,
torchrun starts every rank instead (``torchrun ... -m deepinfer generate ...``): rank 0 runs
the command and the others follow it (``cli.main`` sends them to ``worker_main``).

With data-parallel attention (modes ``"data"`` / ``"data+ep"``) the ranks hold different
requests: rank 0 broadcasts every rank's part of the step, each rank runs its own (one null
token when it has none, so its MoE layers still join the all-to-all exchange), and the
logits rows come back to rank 0 with one gather.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.cache.tiers.codec import BlockCodec
from deepinfer.distributed.eplb import ExpertLoadWindow
from deepinfer.distributed.expert_parallel import apply_placement, shard_experts
from deepinfer.distributed.tensor_parallel import shard_deepseek, shard_llama
from deepinfer.distributed.tiers import (
    FollowedCopies,
    TensorParallelTiers,
    TierSetup,
    follow_tiers,
    tier_group,
)
from deepinfer.errors import EngineDeadError
from deepinfer.lora.registry import LoraRegistry
from deepinfer.models import prepare
from deepinfer.models.layers.lora import LoraStep, running_step
from deepinfer.models.loading import load_model

TIMEOUT_S = 300  # a collective waits this long for a rank before failing
T = TypeVar("T")


@dataclass(frozen=True)
class CacheSetup:
    """What a worker needs to mirror rank 0's cache pools (rank 0 sizes the cache)."""

    block_size: int
    bounded_window: bool
    packed_kv: bool
    kv_dtype: torch.dtype
    num_blocks: int
    num_slots: int
    num_window_blocks: int | None
    count_expert_load: bool = False  # EPLB under data parallel: every rank counts its tokens
    lora: tuple[int, int] | None = None  # served adapters: (max_loras, max_lora_rank)
    tiers: TierSetup | None = None  # KV cache tiers: every rank its own, rank 0 deciding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(
    rank: int, size: int, port: int | None, device: str, check_workers: Callable[[], None] | None = None
) -> None:
    """Join the group: at 127.0.0.1:``port`` (ranks this engine started), or, with no port,
    where torchrun's environment says (MASTER_ADDR / MASTER_PORT). With a port, rank 0 hosts
    the store and waits for every worker to check in, calling ``check_workers`` meanwhile
    (it raises when one died), so a worker lost before it joins never hangs rank 0."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = timedelta(seconds=TIMEOUT_S)
    if port is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
        return
    store = dist.TCPStore(
        "127.0.0.1", port, size, is_master=rank == 0, wait_for_workers=False, timeout=timeout
    )
    if rank == 0:
        joined = [f"deepinfer/joined/{r}" for r in range(1, size)]
        deadline = time.monotonic() + TIMEOUT_S
        while not store.check(joined):
            if check_workers is not None:
                check_workers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel: workers did not join within {TIMEOUT_S} s")
            time.sleep(0.05)
    else:
        store.set(f"deepinfer/joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def _leave_group() -> None:
    """Leave the group once every rank has had the stop: a rank that tears its connections
    down while another still reads from them aborts that one (gloo terminates the process)."""
    dist.barrier()
    dist.destroy_process_group()


def launched_by_torchrun() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process as one of several, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_PORT" not in os.environ:
        return None
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size) if size > 1 else None


def _broadcast(value: Any = None) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


MODES = ("llama", "deepseek", "deepseek+ep", "data", "data+ep")


def parallel_mode(llama: bool, data_parallel_size: int, enable_expert_parallel: bool) -> str:
    """The one choice of ``MODES`` for a model (``llama``: a Llama-family one) and the parallel
    options: rank 0's engine and torchrun's other ranks must shard alike."""
    if data_parallel_size > 1:
        return "data+ep" if enable_expert_parallel else "data"
    if llama:
        return "llama"
    return "deepseek+ep" if enable_expert_parallel else "deepseek"


def shard(model: torch.nn.Module, mode: str, rank: int, size: int) -> None:
    """Keep rank ``rank``'s share: ``"llama"`` (heads and MLP), ``"deepseek"`` (attention
    heads and output groups; experts whole), ``"deepseek+ep"`` (also the routed experts
    split), ``"data"`` (all of it: data-parallel replicas) or ``"data+ep"`` (data-parallel
    attention, routed experts split and reached by all-to-all)."""
    if mode == "data":
        return
    if mode == "data+ep":
        shard_experts(model, rank, size, all_to_all=True)
    elif mode == "llama":
        shard_llama(model, rank, size)
    elif mode in ("deepseek", "deepseek+ep"):
        shard_deepseek(model, rank, size)
        if mode == "deepseek+ep":
            shard_experts(model, rank, size)
    else:
        raise ValueError(f"unknown parallel mode {mode!r}: one of {', '.join(MODES)}")


def worker_main(rank: int, size: int, port: int | None, mode: str, load_kwargs: dict[str, Any]) -> None:
    """A worker rank: load the model and keep its ``mode`` share, mirror the cache, run
    every step rank 0 broadcasts until it broadcasts None. ``port`` None: a torchrun rank
    (its group from the environment)."""
    device = str(load_kwargs.get("device", "cpu"))
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) if port is None else rank}"
        load_kwargs = {**load_kwargs, "device": device}
    if not os.path.isdir(load_kwargs["path"]):  # fail before the group waits for this rank
        raise FileNotFoundError(f"rank {rank}: no checkpoint directory at {load_kwargs['path']}")
    _init_group(rank, size, port, device)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    model = load_model(**load_kwargs)
    shard(model, mode, rank, size)
    setup: CacheSetup = _broadcast()
    prepare.quantize(model, None)  # this rank's projections fused, as rank 0's are
    if device == "cpu":
        prepare.pack_for_cpu(model)
    layout = CacheLayout.from_specs(
        model.cache_spec(), setup.block_size, bounded_window=setup.bounded_window, packed_kv=setup.packed_kv
    )
    pools = allocate_pools(
        layout,
        setup.num_blocks,
        setup.num_slots,
        setup.kv_dtype,
        torch.device(device),
        setup.num_window_blocks,
    )
    counters = ExpertLoadWindow(model, 1).layers if setup.count_expert_load else []
    adapters = None if setup.lora is None else LoraRegistry(model, *setup.lora, setup.lora[0])
    tiers, copies, follower = None, FollowedCopies(), None
    if setup.tiers is not None:  # this rank's tiers, made and fed by their own thread
        group = tier_group()
        tiers = setup.tiers.tiers(BlockCodec(layout, pools), rank, size, group)
        follower = threading.Thread(target=follow_tiers, args=(tiers, group, copies), daemon=True)
        follower.start()
    while (message := _broadcast()) is not None:
        if "placement" in message:  # EPLB: every rank moves its experts together
            apply_placement(model, message["placement"], rank, size)
            continue
        if "dp_step" in message:
            parts, rows = message["dp_step"]
            chunks, input_ids = parts[rank]
            idle = StepPadding(
                setup.num_blocks, setup.num_slots, 1, null_window_block=setup.num_window_blocks
            )
            logits = run_part(model, layout, pools, chunks, input_ids, device, None if chunks else idle)
            gather_rows(logits, rows)
            if counters:
                reduce_expert_load(counters, idle=not chunks)
            continue
        chunks, input_ids, padding = message["step"]
        copies.wait_for(message.get("tier_copies", 0))  # blocks copied out before a step reuses them
        positions, batch = build_forward_batch(layout, pools, chunks, torch.device(device), padding)
        lora = message.get("lora")
        step = None if lora is None or adapters is None else adapters.follow(*lora)
        with torch.inference_mode(), running_step(step):
            model.step(input_ids.to(device), positions, batch)
    if follower is not None and tiers is not None:  # rank 0 stopped it before this message
        follower.join(timeout=TIMEOUT_S)
        tiers.close()
    _leave_group()


def run_part(
    model: torch.nn.Module,
    layout: CacheLayout,
    pools: list,
    chunks: list[SeqChunk],
    input_ids: torch.Tensor,
    device: str,
    padding: StepPadding | None,
) -> torch.Tensor:
    """A data-parallel rank's part of a step over its own pools; its logits."""
    positions, batch = build_forward_batch(layout, pools, chunks, torch.device(device), padding)
    ids = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
    ids[: input_ids.shape[0]] = input_ids.to(device)
    with torch.inference_mode():
        out = model.step(ids, positions, batch)
    return out[0] if isinstance(out, tuple) else out


def gather_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """Rank r's first ``rows[r]`` logits rows, joined in rank order on rank 0 (None
    elsewhere): one gather of tensors padded to the longest part."""
    rank = dist.get_rank()
    most = max(max(rows), 1)
    part = logits.new_zeros(most, logits.shape[-1])
    part[: rows[rank]] = logits[: rows[rank]]
    parts = [torch.empty_like(part) for _ in rows] if rank == 0 else None
    dist.gather(part, parts, dst=0)
    if parts is None:
        return None
    return torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)])


def reduce_expert_load(layers: list[torch.nn.Module], idle: bool = False) -> None:
    """EPLB under data parallel: sum every rank's per-expert token counts into rank 0's
    counters (the others start again from zero). ``idle``: this rank ran only a null token,
    whose routing is not load."""
    if idle:
        for layer in layers:
            layer.expert_load.zero_()
    counts = torch.stack([layer.expert_load for layer in layers])
    dist.reduce(counts, dst=0)
    for layer, total in zip(layers, counts, strict=True):
        if dist.get_rank() == 0:
            layer.expert_load.copy_(total)
        else:
            layer.expert_load.zero_()


class TensorParallelGroup:
    """Rank 0's side: starts ranks 1 .. size - 1 and drives them."""

    def __init__(self, size: int, mode: str, load_kwargs: dict[str, Any]) -> None:
        """Start the workers, or under torchrun (this process rank 0 of ``size``) join the
        ranks torchrun started on this and other machines, which run ``follow``."""
        torchrun = launched_by_torchrun()
        port = None if torchrun is not None else _free_port()
        if torchrun is not None and torchrun != (0, size):
            raise ValueError(
                f"under torchrun this engine is rank/world {torchrun}; expected rank 0 of {size}"
            )
        context = mp.get_context("spawn")
        self.procs = [
            context.Process(target=worker_main, args=(rank, size, port, mode, load_kwargs), daemon=True)
            for rank in (range(1, size) if port is not None else ())
        ]
        for proc in self.procs:
            proc.start()
        self.size = size
        self.closed = False
        self.tiers: TensorParallelTiers | None = None  # the KV cache tiers, where configured
        device = str(load_kwargs.get("device", "cpu"))
        _init_group(0, size, port, device, self._check_started)

    def _check_started(self) -> None:
        """While the workers join: one that died ends the start-up at once, named (the
        others are stopped, they would wait for it forever)."""
        dead = self.dead_ranks()
        if dead:
            for proc in self.procs:
                proc.kill()
            self.closed = True
            raise RuntimeError(f"tensor parallel: worker rank(s) {dead} died before joining the group")

    def checked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which talks to the workers); if it fails, or a worker is gone, raise
        an error naming the ranks that died."""
        try:
            return fn()
        except Exception as exc:
            dead = self.dead_ranks()
            if dead:
                raise EngineDeadError(f"tensor parallel: worker rank(s) {dead} died ({exc})") from exc
            raise

    def dead_ranks(self) -> list[str]:
        return [
            f"{rank} (exit code {proc.exitcode})"
            for rank, proc in enumerate(self.procs, start=1)
            if not proc.is_alive()
        ]

    def setup(self, setup: CacheSetup) -> None:
        self.checked(lambda: _broadcast(setup))

    def step(self, chunks: list, input_ids: torch.Tensor, padding: Any, lora: LoraStep | None = None) -> None:
        """Send a step to every worker (rank 0 then runs its own share); ``lora``: its rows'
        adapter slots and the adapters in them."""
        dead = self.dead_ranks()
        if dead:
            raise EngineDeadError(f"tensor parallel: worker rank(s) {dead} died")
        message: dict[str, Any] = {"step": (chunks, input_ids.cpu(), padding)}
        if self.tiers is not None:
            message["tier_copies"] = self.tiers.copies_sent
        if lora is not None:
            assert lora.slots is not None
            message["lora"] = (lora.slots, lora.placements)
        self.checked(lambda: _broadcast(message))

    def data_parallel_step(self, parts: list[tuple[list[SeqChunk], torch.Tensor]], rows: list[int]) -> None:
        """Send every rank its part of a data-parallel step (chunks and input ids) and the
        logits rows each returns (``gather_rows``); rank 0 then runs its own part."""
        dead = self.dead_ranks()
        if dead:
            raise EngineDeadError(f"tensor parallel: worker rank(s) {dead} died")
        self.checked(lambda: _broadcast({"dp_step": (parts, rows)}))

    def rebalance(self, model: torch.nn.Module, placement: Any) -> None:
        """Move every rank's experts to an EPLB ``placement`` (rank 0's share in ``model``)."""
        self.checked(lambda: _broadcast({"placement": placement}))
        self.checked(lambda: apply_placement(model, placement, 0, self.size))

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.dead_ranks():
                _broadcast(None)
                _leave_group()
        finally:
            for proc in self.procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
