"""Speculative-verification fusion: the acceptance test and residual sampling of
``deepinfer.sampling.rejection`` (``cumprod`` of ``u * q(x) < p(x)`` and
``argmax(cat([max(p - q, 0), p_bonus]) / noise)``) become one
``deepinfer::rejection_sample`` call (kernels/rejection.py). Token assembly stays in the graph.

Anchored on the ``argmax``; one match per verification step traced."""

from __future__ import annotations

import operator
from typing import Any

import torch
from deepinfer.compile_passes.matching import aten, is_op, users_of
from deepinfer.kernels.rejection import rejection_sample_op  # noqa: F401  (registers the op)
from torch.fx import Node


def _sliced_from(node: Any, start_is_zero: bool) -> Node | None:
    """``target_probs`` of ``slice(target_probs, 1, 0, K)`` (or ``slice(.., K, end)``)."""
    if not (is_op(node, aten.slice.Tensor) and node.args[1] == 1):
        return None
    if start_is_zero != (node.args[2] == 0):
        return None
    return node.args[0]


def _gathered(node: Node) -> tuple[Node, Node] | None:
    """(source, draft tokens) of ``squeeze(gather(source, -1, unsqueeze(tokens, -1)), -1)``."""
    if not is_op(node, aten.squeeze.dim):
        return None
    g = node.args[0]
    if not (is_op(g, aten.gather.default) and g.args[1] == -1 and is_op(g.args[2], aten.unsqueeze.default)):
        return None
    return g.args[0], g.args[2].args[0]


def _accepted(target: Node, draft: Node) -> tuple[Node, Node, Node] | None:
    """(sum node, draft tokens, uniform) of the accepted-count subgraph over these probs."""
    for node in draft.users:
        if not is_op(node, aten.gather.default):
            continue
        for sq in users_of(node, aten.squeeze.dim):
            for mul in users_of(sq, aten.mul.Tensor):
                for lt in users_of(mul, aten.lt.Tensor):
                    q_side, p_side = _gathered(sq), _gathered(lt.args[1])
                    if lt.args[0] is not mul or q_side is None or p_side is None:
                        continue
                    if _sliced_from(p_side[0], True) is not target or p_side[1] is not q_side[1]:
                        continue
                    uniform = mul.args[0] if mul.args[1] is sq else mul.args[1]
                    for cast in lt.users:
                        cum = next(iter(users_of(cast, aten.cumprod.default)), None)
                        total = next(iter(users_of(cum, aten.sum.dim_IntList)), None) if cum else None
                        if total is not None:
                            return total, q_side[1], uniform
    return None


def fuse_rejection_sampling(graph: torch.fx.Graph) -> int:
    count = 0
    for argmax in list(graph.nodes):
        if not (is_op(argmax, aten.argmax.default) and argmax.args[1] == -1):
            continue
        div = argmax.args[0]
        if not (is_op(div, aten.div.Tensor) and is_op(div.args[0], aten.cat.default)):
            continue
        cat, noise = div.args
        parts = cat.args[0]
        if len(parts) != 2 or not is_op(parts[0], aten.clamp_min.default) or parts[0].args[1] != 0:
            continue
        sub = parts[0].args[0]
        if not is_op(sub, aten.sub.Tensor):
            continue
        target = _sliced_from(sub.args[0], True)
        if target is None or _sliced_from(parts[1], False) is not target:
            continue
        draft = sub.args[1]
        found = _accepted(target, draft)
        if found is None:
            continue
        total, tokens, uniform = found
        order = {n: i for i, n in enumerate(graph.nodes)}
        anchor = min((argmax, total), key=lambda n: order[n])
        inputs = [target, draft, tokens, uniform, noise]
        if any(isinstance(x, Node) and order[x] >= order[anchor] for x in inputs):
            continue
        with graph.inserting_before(anchor):
            fused = graph.call_function(torch.ops.deepinfer.rejection_sample.default, tuple(inputs))
            accepted = graph.call_function(operator.getitem, (fused, 0))
            recovered = graph.call_function(operator.getitem, (fused, 1))
        accepted.meta["val"], recovered.meta["val"] = total.meta.get("val"), argmax.meta.get("val")
        fused.meta["val"] = (accepted.meta["val"], recovered.meta["val"])
        total.replace_all_uses_with(accepted)
        argmax.replace_all_uses_with(recovered)
        graph.eliminate_dead_code()
        count += 1
    return count
