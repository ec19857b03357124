"""MoE fusion: the plain model's gate (scores, biased top-k or hash ids, gathered weights,
normalisation, scale) followed by ``deepinfer::routed_experts`` becomes one
``deepinfer::fused_moe`` call (kernels/fused_moe.py).

Anchored on each ``routed_experts`` node; walks its weights and ids back to the gate's logits
and recognises the scoring function from its ATen form. One match per MoE layer."""

from __future__ import annotations

import operator

import torch
from deepinfer.compile_passes.matching import aten, is_op, replace_output, strip, val
from deepinfer.kernels.fused_moe import fused_moe  # noqa: F401  (registers the op)
from torch.fx import Node


def _scoring(scores: Node) -> tuple[str, Node] | None:
    """(scoring name, logits) of a scores node in post-grad form, or None."""
    if is_op(scores, aten.sigmoid.default):
        return "sigmoid", scores.args[0]
    if is_op(scores, aten.sqrt.default):  # sqrt(softplus(l)) = sqrt(where(l > 20, l, log1p(exp(l))))
        inner = scores.args[0]
        if is_op(inner, aten.where.self) and is_op(inner.args[0], aten.gt.Scalar):
            logits = inner.args[0].args[0]
            soft = inner.args[2]
            if (
                inner.args[1] is logits
                and is_op(soft, aten.log1p.default)
                and is_op(soft.args[0], aten.exp.default)
            ):
                if soft.args[0].args[0] is logits:
                    return "sqrtsoftplus", logits
    if is_op(scores, aten.div.Tensor) and is_op(scores.args[0], aten.exp.default):  # softmax
        sub = scores.args[0].args[0]
        if is_op(sub, aten.sub.Tensor) and is_op(sub.args[1], aten.amax.default):
            if sub.args[1].args[0] is sub.args[0] and is_op(scores.args[1], aten.sum.dim_IntList):
                return "softmax", sub.args[0]
    if is_op(scores, torch.ops.aten._softmax.default):
        return "softmax", scores.args[0]
    return None


def _match(node: Node) -> tuple | None:
    x, weights, ids, w1, w2, w3, limit = node.args
    if not is_op(weights, aten.mul.Tensor):
        return None
    normalized, scale = weights.args
    normalize = False
    gathered = normalized
    if is_op(normalized, aten.div.Tensor):  # weights / (weights.sum(-1, keepdim=True) + 1e-20)
        denom = normalized.args[1]
        if not (is_op(denom, aten.add.Tensor) and is_op(denom.args[0], aten.sum.dim_IntList)):
            return None
        gathered, normalize = normalized.args[0], True
        if denom.args[0].args[0] is not gathered:
            return None
    if not (is_op(gathered, aten.gather.default) and gathered.args[1] == 1 and gathered.args[2] is ids):
        return None
    scores = strip(gathered.args[0])
    found = _scoring(scores)
    if found is None:
        return None
    scoring, logits = found
    bias = hash_ids = None
    top_k = val(ids).shape[-1] if val(ids) is not None else None
    if is_op(ids, operator.getitem) and is_op(ids.args[0], aten.topk.default) and ids.args[1] == 1:
        topk = ids.args[0]
        biased = topk.args[0]
        if not (is_op(biased, aten.add.Tensor) and strip(biased.args[0]) is scores):
            return None
        bias, top_k = biased.args[1], topk.args[1]
    else:
        hash_ids = ids
    if not isinstance(top_k, int):
        return None
    if not isinstance(scale, Node):  # a constant scale becomes a 0-d tensor argument
        scale = float(scale)
    return x, logits, bias, hash_ids, w1, w2, w3, top_k, scoring, normalize, scale, limit


def fuse_moe(graph: torch.fx.Graph) -> int:
    """Replace gate + routed experts with ``fused_moe``; returns the number of MoE layers fused."""
    count = 0
    for node in list(graph.nodes):
        if not is_op(node, torch.ops.deepinfer.routed_experts.default):
            continue
        found = _match(node)
        if found is None:
            continue
        *head, scale, limit = found
        if isinstance(scale, float):  # a 0-d tensor on the experts' device (never a host
            # tensor: Inductor would emit a CPU kernel inside a CUDA graph)
            x_val = val(head[0])
            device = x_val.device if x_val is not None else None
            with graph.inserting_before(node):
                scale = graph.call_function(
                    aten.scalar_tensor.default, (scale,), {"dtype": torch.float32, "device": device}
                )
                scale.meta["val"] = torch.empty((), device=device)
        replace_output(graph, node, torch.ops.deepinfer.fused_moe.default, (*head, scale, limit))
        count += 1
    return count
