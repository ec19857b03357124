"""Sinkhorn normalisation of the mHC stream mixer (model_spec.md §2.2).

``reference`` is the plain PyTorch definition. On CPU the same arithmetic runs through
NumPy: the matrices are tiny ([T, 4, 4]) and the 38 row/column normalisations are pure
per-op overhead in eager PyTorch (~10 us each against ~1.5 us in NumPy), which made this the
largest single cost of a decode step. Both paths compute in fp32, row by row, so a row's
result does not depend on the batch around it.
"""

from __future__ import annotations

import numpy as np
import torch


def reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax rows, then alternate column/row normalisation, ending on columns."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = torch.softmax(comb, dim=-1).numpy().copy()
    e = np.float32(eps)
    c += e
    c /= c.sum(axis=-2, keepdims=True) + e
    for _ in range(iters - 1):
        c /= c.sum(axis=-1, keepdims=True) + e
        c /= c.sum(axis=-2, keepdims=True) + e
    return torch.from_numpy(c)


@torch.library.custom_op("deepinfer::sinkhorn", mutates_args=())
def sinkhorn_op(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The custom op: opaque to ``torch.compile``, so the 2 * iters normalisations of every
    mHC site do not unroll into the traced graph (they are per-op overhead, not math)."""
    if comb.device.type == "cpu" and comb.dtype == torch.float32:
        return _numpy(comb.contiguous(), iters, eps)
    return reference(comb, iters, eps)


@sinkhorn_op.register_fake
def _(comb, iters, eps):
    return torch.empty_like(comb)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """fp32 [..., n, n] logits -> doubly-stochastic (up to eps) mixing matrices."""
    if comb.requires_grad:
        return reference(comb, iters, eps)
    return sinkhorn_op(comb, iters, eps)
