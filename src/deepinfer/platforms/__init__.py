"""Platforms: per device kind, whether the model step is compiled by default, how decode steps
are captured and replayed as graphs, and which kernels exist (docs/architecture.md,
'Compilation, passes and ops').

``platform_for(device)`` returns the ``Platform`` of a ``torch.device``. CUDA graphs need a
CUDA build of torch; Ascend's graph mode needs ``torch_npu``, which is never installed by
default and is imported only when an ``npu`` device is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# A graph backend captures ``fn`` (reading and writing only static tensors) and returns a
# replay callable that re-runs the captured work and returns ``fn``'s static output (the
# logits, or the logits and the step's routing trace).
GraphOutput = torch.Tensor | tuple[torch.Tensor, ...]
GraphCapture = Callable[[Callable[[], GraphOutput]], Callable[[], GraphOutput]]


@dataclass(frozen=True)
class Platform:
    name: str
    compile_by_default: bool  # torch.compile measured faster than eager here
    capture: GraphCapture | None  # None: no graph mode on this platform
    has_triton: bool  # Triton kernels may replace the reference kernels


def resolve_device(name: str | torch.device) -> torch.device:
    """``torch.device(name)``, importing ``torch_npu`` first for ``npu`` (it registers the
    device type) and saying so plainly when it is not installed."""
    if isinstance(name, torch.device):
        return name
    if str(name).split(":")[0] == "npu":
        from deepinfer.platforms.npu import _torch_npu

        _torch_npu()
    return torch.device(name)


def platform_for(device: torch.device) -> Platform:
    if device.type == "cuda":
        from deepinfer.platforms.cuda import cuda_platform

        return cuda_platform()
    if device.type == "npu":
        from deepinfer.platforms.npu import npu_platform

        return npu_platform()
    from deepinfer.platforms.cpu import cpu_platform

    return cpu_platform()
