"""KV cache tiers under tensor parallel: every rank keeps its own cut of each block (its pools
hold its heads) in its own tiers, under its own disk namespace, and rank 0 decides.

Rank 0's scheduler speaks to ``TensorParallelTiers`` as to any ``KVTiers``. Each copy it makes
out of its pools and each load it starts go, in order, to the workers over a gloo group of
their own (``tier_group``), sent from rank 0's loader thread; on each worker a thread
(``follow_tiers``) makes the same copy out of its pools or the same load into them. A load
counts as found only where every rank found its part (``agree``: the minimum over the ranks),
so a rank whose tier lost an entry (evicted, a disk write dropped, a corrupt file) makes the
scheduler look the prefix up again on every rank, never serve a block one rank lacks.

A copy must read its blocks before a later step writes them: rank 0 copies between steps,
and every step message carries how many copies rank 0 had sent (``copies_sent``); a worker
waits until its thread has made that many before it runs the step. A load fills blocks no
step reads before it is agreed, as on one rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.cache.tiers import KVTiers
from deepinfer.cache.tiers.codec import BlockCodec

Items = list[tuple[bytes, Any, Any]]


@dataclass(frozen=True)
class TierSetup:
    """The tiers every rank makes over its own pools (``KVTiers``' arguments but the codec);
    ``namespace``: the model's, each rank's under it (``rank_namespace``)."""

    host_bytes: int
    disk_dir: str | None
    disk_bytes: int
    namespace: str

    def tiers(self, codec: BlockCodec, rank: int, size: int, group: dist.ProcessGroup) -> KVTiers:
        """Rank ``rank``'s tiers: rank 0's send what they do to the others."""
        name = rank_namespace(self.namespace, rank, size)
        if rank == 0:
            return TensorParallelTiers(codec, self.host_bytes, self.disk_dir, self.disk_bytes, name, group)
        return KVTiers(codec, self.host_bytes, self.disk_dir, self.disk_bytes, name)


def tier_group() -> dist.ProcessGroup:
    """The tiers' own group over every rank (a collective: each rank calls it at the same
    point), so their messages never interleave with a step's."""
    return dist.new_group(backend="gloo")


def _send(message: Any, group: dist.ProcessGroup) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree(found: bool, group: dist.ProcessGroup) -> bool:
    """Whether every rank found its part of a load."""
    flag = torch.tensor([int(found)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def rank_namespace(namespace: str, rank: int, size: int) -> str:
    """A rank's disk namespace: its cut of the blocks, beside the other ranks'."""
    return f"{namespace}-tp{rank}of{size}"


class TensorParallelTiers(KVTiers):
    """Rank 0's tiers: its own copies and loads, each also sent to the workers."""

    def __init__(
        self,
        codec: BlockCodec,
        host_bytes: int,
        disk_dir: Any,
        disk_bytes: int,
        namespace: str,
        group: dist.ProcessGroup,
    ) -> None:
        super().__init__(codec, host_bytes, disk_dir, disk_bytes, namespace)
        self.group = group
        self.copies_sent = 0  # copies handed to the loader thread to send

    def copy_blocks(self, items: Items) -> None:
        super().copy_blocks(items)
        self.copies_sent += 1
        self._loader.submit(_send, ("copy", list(items)), self.group)

    def load_blocks(self, items: Items) -> bool:
        _send(("load", list(items)), self.group)  # on the loader thread, after earlier copies
        return agree(super().load_blocks(items), self.group)

    def weights_changed(self) -> None:
        super().weights_changed()
        self._loader.submit(_send, ("weights", None), self.group).result()

    def close(self) -> None:
        """Finish the copies, stop the workers' tier threads, then this rank's threads."""
        self.flush()
        self._loader.submit(_send, None, self.group).result()
        super().close()


class FollowedCopies:
    """A worker's count of copies made, which a step waits on (``wait_for``)."""

    def __init__(self) -> None:
        self.made = 0
        self._changed = threading.Condition()

    def add(self) -> None:
        with self._changed:
            self.made += 1
            self._changed.notify_all()

    def wait_for(self, count: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.made >= count)


def follow_tiers(tiers: KVTiers, group: dist.ProcessGroup, copies: FollowedCopies) -> None:
    """A worker's tier thread: rank 0's copies and loads in order, until rank 0 stops it."""
    while (message := _send(None, group)) is not None:
        kind, items = message
        if kind == "copy":
            tiers.copy_blocks(items)
            copies.add()
        elif kind == "load":
            agree(tiers.load_blocks(items), group)
        else:  # the weights changed: what the tiers hold is for the old ones
            tiers.weights_changed()
