"""Host tensors of a step's metadata and their copy to the device: made from NumPy arrays
and int lists without torch's slower conversions, copied without blocking the host."""

from __future__ import annotations

import numpy as np
import torch


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` on the host through NumPy, whose conversion of
    a list of ints is several times faster."""
    return torch.from_numpy(np.fromiter(values, np.int64, len(values)))


def host_tensor(values: np.ndarray) -> torch.Tensor:
    """A host tensor over a NumPy array's memory (C-contiguous, as the compiled step's guards
    expect of every metadata tensor)."""
    return torch.from_numpy(np.ascontiguousarray(values))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> ``device`` without blocking the host: from pinned memory on CUDA, so building
    step N+1 never waits for step N's kernels (asynchronous scheduling)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device_together(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Many host tensors on ``device`` in one copy per dtype: each dtype's tensors are packed
    into one (pinned, on CUDA) buffer, copied once without blocking the host, and handed back
    as views of the copy, in order. A step's metadata is dozens of small tensors; a copy each
    costs a launch and a pinned allocation each."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    pin = device.type == "cuda"
    for dtype, members in by_dtype.items():
        total = sum(tensors[i].numel() for i in members)
        buffer = torch.empty(total, dtype=dtype, pin_memory=pin)
        offset = 0
        for i in members:
            n = tensors[i].numel()
            buffer[offset : offset + n].copy_(tensors[i].reshape(-1))
            offset += n
        moved = buffer.to(device, non_blocking=pin)
        offset = 0
        for i in members:
            n = tensors[i].numel()
            out[i] = moved[offset : offset + n].view(tensors[i].shape)
            offset += n
    return [t for t in out if t is not None]


class HostCopy:
    """A device tensor's copy to the host, queued right after the kernels that make it (and
    before the next step's): reading it waits for those kernels only. A read of the device
    tensor itself, made after the next step was launched, would wait for that step too."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ready: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
            tensor = host
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor

    def tolist(self) -> list:
        return self.wait().tolist()
