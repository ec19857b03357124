"""FX passes run on Inductor's post-grad graphs by ``deepinfer.compile.compilation.PassManager``
(import name ``deepinfer.compile_passes``).

A pass is ``fn(graph: torch.fx.Graph) -> int``: it rewrites matched subgraphs in place and
returns how many it rewrote. ``PASSES`` is the full pipeline (``compilation.default_passes``
picks per platform; the CPU keeps the verification fusion and adds the small-bmm rewrite):

- ``fuse_sink_attention``: the V4/V4.1 attention core -> ``deepinfer::sink_attention``;
- ``fuse_moe``: MoE gate + routed experts -> ``deepinfer::fused_moe``;
- ``fuse_rejection_sampling``: speculative verification -> ``deepinfer::rejection_sample``;
- ``use_row_sink_attention`` (CPU only, not in ``PASSES``): attention cores over pool gathers
  -> ``deepinfer::sink_attention_rows_cpu`` (reads the pool rows through the indices);
- ``reduce_small_bmm`` (CPU only, not in ``PASSES``): memory-bound ``bmm``s -> mul + sum;
- ``use_packed_linear`` (CPU only, not in ``PASSES``): weight projections ->
  ``deepinfer::packed_linear`` (packed weight copies, a C++ kernel behind the dispatcher);
- ``use_native_cpu_ops`` (CPU only, not in ``PASSES``): the Python custom ops
  ``routed_experts`` / ``sinkhorn`` / ``indexer_topk`` -> their C++ dispatcher twins
  (``kernels/cpu/step_ops.py``).

Llama's paged attention is a custom op the model calls directly (``paged_attention``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepinfer.compile_passes.attention import fuse_sink_attention
from deepinfer.compile_passes.moe import fuse_moe
from deepinfer.compile_passes.native_cpu_ops import use_native_cpu_ops
from deepinfer.compile_passes.packed_linear import use_packed_linear
from deepinfer.compile_passes.row_attention import use_row_sink_attention
from deepinfer.compile_passes.small_bmm import reduce_small_bmm
from deepinfer.compile_passes.verification import fuse_rejection_sampling

__all__ = [
    "PASSES",
    "fuse_moe",
    "fuse_rejection_sampling",
    "fuse_sink_attention",
    "reduce_small_bmm",
    "use_native_cpu_ops",
    "use_packed_linear",
    "use_row_sink_attention",
]

PASSES: tuple[Callable[[torch.fx.Graph], int], ...] = (fuse_sink_attention, fuse_moe, fuse_rejection_sampling)
