"""Worker processes of a tensor- or expert-parallel engine: one per extra rank, started by rank 0's
engine (``torch.multiprocessing``, spawn), joined in one ``torch.distributed`` group (gloo on
the CPU; NCCL on CUDA, untested). Rank 0 schedules; before each step it broadcasts the step's
chunks and input ids, every rank builds the same step metadata over its own cache pools and
runs its share of the model, and the layers' all-reduces keep the ranks in lockstep. A
worker that dies shows up as a failed collective on rank 0, which then names the dead rank
(``TensorParallelGroup.checked``); one that hangs, after ``TIMEOUT_S``. Across machines,
torchrun starts every rank instead (``torchrun ... -m deepinfer generate ...``): rank 0 runs
the command and the others follow it (``cli.main`` sends them to ``worker_main``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.distributed.expert_parallel import apply_placement, shard_experts
from deepinfer.distributed.tensor_parallel import shard_deepseek, shard_llama
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, size: int, port: int | None, device: str) -> None:
    """Join the group: at 127.0.0.1:``port`` (ranks this engine started), or, with no port,
    where torchrun's environment says (MASTER_ADDR / MASTER_PORT)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


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


def shard(model: torch.nn.Module, mode: str, rank: int, size: int) -> None:
    """Keep rank ``rank``'s share: ``"llama"`` (heads and MLP), ``"deepseek"`` (attention
    heads and output groups; experts whole) or ``"deepseek+ep"`` (also the routed experts
    split)."""
    if mode == "llama":
        shard_llama(model, rank, size)
    elif mode in ("deepseek", "deepseek+ep"):
        shard_deepseek(model, rank, size)
        if mode == "deepseek+ep":
            shard_experts(model, rank, size)
    else:
        raise ValueError(f"unknown parallel mode {mode!r}")


def worker_main(rank: int, size: int, port: int | None, mode: str, load_kwargs: dict[str, Any]) -> None:
    """A worker rank: load the model and keep its ``mode`` share, mirror the cache, run
    every step rank 0 broadcasts until it broadcasts None. ``port`` None: a torchrun rank
    (its group from the environment)."""
    device = str(load_kwargs.get("device", "cpu"))
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) if port is None else rank}"
        load_kwargs = {**load_kwargs, "device": device}
    _init_group(rank, size, port, device)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    model = load_model(**load_kwargs)
    shard(model, mode, rank, size)
    setup: CacheSetup = _broadcast()
    if device == "cpu":
        model.pack_weights()
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
    while (message := _broadcast()) is not None:
        if "placement" in message:  # EPLB: every rank moves its experts together
            apply_placement(model, message["placement"], rank, size)
            continue
        chunks, input_ids, padding = message["step"]
        positions, batch = build_forward_batch(layout, pools, chunks, torch.device(device), padding)
        with torch.inference_mode():
            model.step(input_ids.to(device), positions, batch)
    _leave_group()


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
        self.checked(lambda: _init_group(0, size, port, str(load_kwargs.get("device", "cpu"))))

    def checked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which talks to the workers); if it fails, or a worker is gone, raise
        an error naming the ranks that died."""
        try:
            return fn()
        except Exception as exc:
            dead = self.dead_ranks()
            if dead:
                raise RuntimeError(f"tensor parallel: worker rank(s) {dead} died ({exc})") from exc
            raise

    def dead_ranks(self) -> list[str]:
        return [
            f"{rank} (exit code {proc.exitcode})"
            for rank, proc in enumerate(self.procs, start=1)
            if not proc.is_alive()
        ]

    def setup(self, setup: CacheSetup) -> None:
        self.checked(lambda: _broadcast(setup))

    def step(self, chunks: list, input_ids: torch.Tensor, padding: Any) -> None:
        """Send a step to every worker (rank 0 then runs its own share)."""
        dead = self.dead_ranks()
        if dead:
            raise RuntimeError(f"tensor parallel: worker rank(s) {dead} died")
        self.checked(lambda: _broadcast({"step": (chunks, input_ids.cpu(), padding)}))

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
