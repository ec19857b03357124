"""The step's Python custom ops -> their C++ dispatcher twins (CPU only).

``deepinfer::routed_experts``, ``deepinfer::sinkhorn``, ``deepinfer::indexer_topk`` and
``deepinfer::rope`` run Python for every call a compiled step's C++ wrapper makes (39 a tiny-V4
step, 22 of them RoPE).
``kernels/cpu/step_ops.py`` registers C++ ops with the same schemas and kernels, which hand
any input their kernels do not take back to the Python op; this pass points each fp32 CPU
call at them. Installed only where they built."""

from __future__ import annotations

import torch
from deepinfer.compile_passes.matching import is_op, val


def use_native_cpu_ops(graph: torch.fx.Graph) -> int:
    """Retarget each ``routed_experts`` / ``sinkhorn`` / ``indexer_topk`` / ``rope`` call on fp32 CPU
    tensors that need no gradient; returns how many."""
    from deepinfer.kernels.cpu import step_ops as cpu_step_ops

    if not cpu_step_ops.available():  # the ops are not registered in this process
        return 0
    twins = {
        torch.ops.deepinfer.routed_experts.default: torch.ops.deepinfer.routed_experts_cpu.default,
        torch.ops.deepinfer.sinkhorn.default: torch.ops.deepinfer.sinkhorn_cpu.default,
        torch.ops.deepinfer.indexer_topk.default: torch.ops.deepinfer.indexer_topk_cpu.default,
        torch.ops.deepinfer.rope.default: torch.ops.deepinfer.rope_cpu.default,
    }
    count = 0
    for node in graph.nodes:
        twin = next((t for op, t in twins.items() if is_op(node, op)), None)
        first = val(node.args[0]) if twin is not None and node.args else None
        if first is None or first.device.type != "cpu" or first.dtype != torch.float32 or first.requires_grad:
            continue
        node.target = twin
        count += 1
    return count
