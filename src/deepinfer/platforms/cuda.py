"""NVIDIA: compiled by default, decode steps captured as CUDA graphs, Triton kernels.

Capture follows PyTorch's recipe (docs "CUDA Graphs"): warm up on a side stream (this also
triggers the compile), then record under ``torch.cuda.graph`` into one memory pool shared by
every bucket; larger buckets are captured first so smaller ones reuse their memory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from deepinfer.platforms import GraphOutput, Platform

_POOL = None


def capture_cuda_graph(fn: Callable[[], GraphOutput]) -> Callable[[], GraphOutput]:
    global _POOL
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_POOL):
        out = fn()

    def replay() -> GraphOutput:
        graph.replay()
        return out

    return replay


def cuda_platform() -> Platform:
    return Platform(
        name="cuda",
        compile_by_default=True,
        capture=capture_cuda_graph,
        has_triton=importlib.util.find_spec("triton") is not None,
    )
