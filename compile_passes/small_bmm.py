"""Memory-bound batched matmuls as Inductor reductions (CPU).

A V4 step runs many ``bmm``s whose matrices are tiny per batch entry: the hyper-connection
stream mix (``[T, n, n] @ [T, n, d]`` with n = 4) and, on small models, attention over each
token's gathered window (``[T, H, D] @ [T, D, L]`` with few heads). Such a product does a few
multiply-adds per element it reads, so it is bound by memory, not arithmetic, and a BLAS call
adds only its per-call cost on top (a tiny V4 step runs dozens of them, a sizeable share of its
time; benchmarks/RESULTS.md). Written as
``sum(a[..., None] * b[:, None], 2)`` it becomes a reduction Inductor generates in C++ and can
fuse with the ops around it (the window gather, the softmax, the stream add).

The rewrite takes a ``bmm`` only when its arithmetic intensity (multiply-adds per element read
or written) is at most ``MAX_INTENSITY`` for every value of its symbolic sizes: a symbolic size
counts as unbounded, so the bound is the limit as it grows. Products that are compute bound
(a real-size V4's 128 heads of 512) keep their ``bmm``. The sum order over the inner dimension
may differ from BLAS's, so results can move by rounding, never more."""

from __future__ import annotations

import math

import torch
from deepinfer.compile_passes.matching import aten, is_op, val

# Multiply-adds per element touched below which a product is memory bound on a CPU: a core does
# tens of fp32 multiply-adds in the time it streams one element from memory.
MAX_INTENSITY = 8.0


def intensity_bound(m: object, k: object, n: object) -> float:
    """Largest ``m*k*n / (m*k + k*n + m*n)`` over the symbolic sizes (non-ints) growing without
    bound; ``inf`` when two or more are symbolic (the bound does not exist)."""
    sizes = [s if isinstance(s, int) else None for s in (m, k, n)]
    unknown = sizes.count(None)
    if unknown == 0:
        a, b, c = sizes
        return a * b * c / max(a * b + b * c + a * c, 1)
    if unknown > 1:
        return math.inf
    a, b = (s for s in sizes if s is not None)
    return a * b / max(a + b, 1)  # the limit as the symbolic size grows


def _static(size: object) -> object:
    """An int for a size that is a plain or constant symbolic int, the size itself otherwise."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt) and size.node.is_constant():
        return int(size)
    return size


def reduce_small_bmm(graph: torch.fx.Graph) -> int:
    """Rewrite each memory-bound floating-point ``bmm`` as a mul + sum; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_op(node, aten.bmm.default):
            continue
        a, b = node.args[:2]
        a_val, b_val = val(a), val(b)
        if a_val is None or b_val is None or not a_val.dtype.is_floating_point:
            continue
        if a_val.dtype != b_val.dtype:
            continue
        _, m, k = (_static(s) for s in a_val.shape)
        n = _static(b_val.shape[2])
        if not isinstance(k, int) or intensity_bound(m, k, n) > MAX_INTENSITY:
            continue  # a symbolic inner size: Inductor vectorises the short sum, and loses
        with graph.inserting_before(node):
            left = graph.call_function(aten.unsqueeze.default, (a, 3))  # [B, M, K, 1]
            right = graph.call_function(aten.unsqueeze.default, (b, 1))  # [B, 1, K, N]
            product = graph.call_function(aten.mul.Tensor, (left, right))
            total = graph.call_function(aten.sum.dim_IntList, (product, [2]))
        left.meta["val"] = a_val.unsqueeze(3)
        right.meta["val"] = b_val.unsqueeze(1)
        product.meta["val"] = left.meta["val"] * right.meta["val"]
        total.meta["val"] = product.meta["val"].sum(2)
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        count += 1
    return count
