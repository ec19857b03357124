"""FX passes run on Inductor's post-grad graphs by ``deepinfer.compilation.PassManager``
(import name ``deepinfer.compile_passes``).

A pass is ``fn(graph: torch.fx.Graph) -> int``: it rewrites matched subgraphs in place and
returns how many it rewrote. ``PASSES`` is the default pipeline. It is empty so far: the
attention, MoE and speculative-verification fusions of DESIGN.md §4 are the next steps of
the compiler issue; the MoE expert loop and Sinkhorn are already custom ops the model calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PASSES: tuple[Callable[[torch.fx.Graph], int], ...] = ()
