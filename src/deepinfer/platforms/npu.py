"""Ascend: the NPU graph mode of ``torch_npu`` (its ``torch.npu.NPUGraph`` mirrors
``torch.cuda.CUDAGraph``). ``torch_npu`` is an optional dependency that is never installed by
default; without it asking for an ``npu`` device raises a clear error. Nothing here has run
on Ascend hardware yet (README: what ran where)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.platforms import GraphOutput, Platform


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the npu device and torch.npu)
    except ImportError as e:
        raise RuntimeError(
            "device='npu' needs the torch_npu package (Ascend), which deepinfer does not install"
        ) from e
    return torch.npu  # type: ignore[attr-defined]


def capture_npu_graph(fn: Callable[[], GraphOutput]) -> Callable[[], GraphOutput]:
    npu = _torch_npu()
    fn()  # warm-up (compile, allocator)
    graph = npu.NPUGraph()
    with npu.graph(graph):
        out = fn()

    def replay() -> GraphOutput:
        graph.replay()
        return out

    return replay


def npu_platform() -> Platform:
    _torch_npu()
    return Platform(name="npu", compile_by_default=False, capture=capture_npu_graph, has_triton=False)
