"""The whole routed half of a MoE layer as one op: ``deepinfer::fused_moe``.

gate scores (``sqrtsoftplus`` | ``sigmoid`` | ``softmax``) -> expert choice (biased top-k, or
a hash table's ids) -> weights (gathered, optionally normalised, scaled) -> sorted dispatch,
clamped SwiGLU experts and the weighted combine (``routed_experts``). The compiler's MoE pass
(compile_passes/moe.py) swaps the plain model's gate + ``routed_experts`` for it. The
reference implementation runs on every device; its experts call ``routed_experts``, whose CUDA
and ``meta`` kernel is the grouped one with no host read, so a captured graph can hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.kernels.moe import routed_experts

SCORING = ("sqrtsoftplus", "sigmoid", "softmax")


def gate_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")


@torch.library.custom_op("deepinfer::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, d]; logits [N, E] (the gate's matmul); either ``bias`` [E] (selection by top-k of
    scores + bias) or ``hash_ids`` [N, k]. Returns the routed experts' combined output [N, d]."""
    scores = gate_scores(logits, scoring)
    if hash_ids is not None:
        ids = hash_ids
    else:
        assert bias is not None, "fused_moe needs a selection bias or hash ids"
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scale.to(weights.dtype)
    return routed_experts(x, weights, ids, w1, w2, w3, limit)


@fused_moe.register_fake
def _(x, logits, bias, hash_ids, w1, w2, w3, top_k, scoring, normalize, scale, limit):
    return torch.empty_like(x)
