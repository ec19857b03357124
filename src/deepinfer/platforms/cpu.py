"""CPU: eager by default (Inductor's first compile of a V4 step pays back only on long runs;
compile vs eager: benchmarks/RESULTS.md), no graph mode, no Triton kernels.

``replay_eagerly`` is a graph backend in name only: replay calls the function again on the
same static tensors. It lets the CPU tests exercise the graph runner's bucketing, padding
and static-buffer logic, which is the part that decides correctness on a GPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.platforms import Platform


def replay_eagerly(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    fn()  # the warm-up run a real capture makes (it touches only null cache rows)
    return fn


def cpu_platform() -> Platform:
    return Platform(name="cpu", compile_by_default=False, capture=None, has_triton=False)
