"""``torch.compile`` wiring (DESIGN.md §4): the model's step compiled by Inductor with the token
dimension dynamic, and our FX pass manager installed as Inductor's post-grad custom pass.

The pass manager is a ``CustomGraphPass``: Inductor's FX-graph cache keys on its ``uuid()``,
which hashes the source of every installed pass, so editing a pass invalidates cached graphs
and nothing else does. Each pass returns how many subgraphs it rewrote; the manager logs the
counts and keeps them for tests (``PassManager.counts``).

The custom ops the model calls (``deepinfer::routed_experts``, ``deepinfer::sinkhorn``) are
opaque to the tracer, so a V4/V4.1 step traces as one graph with no graph breaks.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

logger = logging.getLogger(__name__)

GraphPass = Callable[[torch.fx.Graph], int]  # rewrites in place, returns the match count


class PassManager(CustomGraphPass):
    """Runs ``passes`` in order on each post-grad graph Inductor compiles."""

    def __init__(self, passes: Sequence[GraphPass] = ()) -> None:
        self.passes = list(passes)
        self.counts: Counter[str] = Counter()
        self.graphs_seen = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs_seen += 1
        for graph_pass in self.passes:
            matched = graph_pass(graph)
            self.counts[graph_pass.__name__] += matched
            logger.info("compile pass %s: %d match(es)", graph_pass.__name__, matched)
        graph.lint()

    def uuid(self) -> bytes:
        digest = hashlib.sha256(b"deepinfer-pass-manager-v1")
        for graph_pass in self.passes:
            digest.update(inspect.getsource(graph_pass).encode())
        return digest.digest()


def default_passes() -> list[GraphPass]:
    """The passes installed by default (``compile_passes`` package)."""
    from deepinfer.compile_passes import PASSES

    return list(PASSES)


# Graph variants one step function may compile before dynamo gives up and runs eagerly.
RECOMPILE_LIMIT = 64


def compile_step(
    model: nn.Module, backend: str = "inductor", passes: Sequence[GraphPass] | None = None
) -> Callable[..., torch.Tensor]:
    """A compiled ``model(input_ids, positions, batch)``. Shapes are dynamic from the first
    call (``dynamic=True``) for the token count. Known limit: sizes of 0 and 1 specialise, and
    the compressor bookkeeping tensors of the ForwardBatch (rows of groups closing, buffers,
    snapshots) take sizes 0, 1 or more independently, so an engine workload compiles several
    graph variants (about 8 on the tiny V4) before it settles; making that metadata
    branch-free with padded sizes is the next step."""
    manager = PassManager(default_passes() if passes is None else passes)
    options = {"post_grad_custom_post_pass": manager} if backend == "inductor" else None
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(model.step, backend=backend, dynamic=True, options=options)
    compiled.pass_manager = manager  # type: ignore[attr-defined]
    return compiled
