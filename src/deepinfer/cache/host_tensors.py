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
