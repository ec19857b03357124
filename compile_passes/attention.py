"""Attention fusion: the V4/V4.1 attention core as the plain model writes it
(``attention_with_sink``: per part ``where(visible, bmm(q, kv^T) * scale, -inf)``, one
softmax over the parts and the expanded sink, ``bmm(probs_i, kv_i)`` summed) becomes one
``deepinfer::sink_attention`` call (kernels/sink_attention.py).

Anchored on the ``cat`` whose last input is the expanded sink; one match per attention
layer. The query/KV projections, RoPE, the cache write and the output projection around it
stay in the graph for Inductor to fuse."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from deepinfer.compile_passes.matching import RESHAPES, arg, aten, is_op, replace_output, strip, users_of
from deepinfer.kernels.sink_attention import sink_attention  # noqa: F401  (registers the op)
from torch.fx import Node


def _is_negative_infinity(node: Node) -> bool:
    """A scalar -inf: ``scalar_tensor(-inf)``, or ``full([], -inf)`` as Inductor's own
    compile (not the post-grad backend) leaves it."""
    if is_op(node, aten.scalar_tensor.default):
        value = node.args[0]
    elif is_op(node, aten.full.default) and list(node.args[0]) == []:
        value = node.args[1]
    else:
        return False
    return isinstance(value, float) and math.isinf(value) and value < 0


def _score_part(node: Node) -> tuple[Node, Node, Node, float] | None:
    """(q, kv, visible, scale) of ``where(unsqueeze(visible, 1), bmm(q, permute(kv)) * s, -inf)``."""
    if not is_op(node, aten.where.self):
        return None
    cond, scores, fill = node.args
    if not (is_op(cond, aten.unsqueeze.default) and cond.args[1] == 1):
        return None
    if not _is_negative_infinity(fill):
        return None
    if not (is_op(scores, aten.mul.Tensor) and isinstance(scores.args[1], float)):
        return None
    bmm = scores.args[0]
    if not is_op(bmm, aten.bmm.default):
        return None
    q, kt = bmm.args
    if not (is_op(kt, aten.permute.default) and list(kt.args[1]) == [0, 2, 1]):
        return None
    return q, kt.args[0], cond.args[0], scores.args[1]


def _softmax_of(cat: Node) -> Node | None:
    """The ``div`` ending ``softmax(cat, -1)`` in its decomposed form."""
    for amax in users_of(cat, aten.amax.default):
        for sub in users_of(amax, aten.sub.Tensor):
            if sub.args[0] is not cat:
                continue
            for exp in users_of(sub, aten.exp.default):
                for div in users_of(exp, aten.div.Tensor):
                    if div.args[0] is exp and is_op(div.args[1], aten.sum.dim_IntList):
                        return div
    return None


def _same_value(a: object, b: object) -> bool:
    """``a`` is ``b``, or both reshape one node to the same sizes (Inductor's own compile
    leaves such twins uneliminated where the model reads one gathered tensor twice)."""
    if a is b:
        return True
    return (
        is_op(a, *RESHAPES)
        and is_op(b, *RESHAPES)
        and a.args[0] is b.args[0]
        and list(a.args[1]) == list(b.args[1])
    )


def _output_of(probs: Node, kvs: list[Node]) -> Node | None:
    """The node summing ``bmm(slice(probs, 2, start_i, end_i), kv_i)`` over the parts."""
    terms: list[Node] = []
    for kv in kvs:
        found = None
        for sl in users_of(probs, aten.slice.Tensor):
            for user in sl.users:
                bmm = user if is_op(user, aten.bmm.default) else None
                if bmm is None and is_op(user, torch.ops.prims.convert_element_type.default):
                    bmm = next(iter(users_of(user, aten.bmm.default)), None)
                if bmm is not None and _same_value(bmm.args[1], kv) and strip(bmm.args[0]) is sl:
                    found = bmm
        if found is None:
            return None
        terms.append(found)
    out = terms[0]
    for term in terms[1:]:
        adds = [u for u in out.users if is_op(u, aten.add.Tensor) and set(u.args[:2]) == {out, term}]
        if len(adds) != 1:
            return None
        out = adds[0]
    return out


@dataclass
class AttentionCore:
    """One matched attention core: ``out`` = softmax over the parts' scores and the sink,
    applied to the parts' values (``attention_with_sink``'s result node)."""

    out: Node
    q: Node
    kvs: list[Node]
    visibles: list[Node]
    sink: Node
    scale: float


def attention_cores(graph: torch.fx.Graph) -> Iterator[AttentionCore]:
    """Each attention core of ``graph`` in order; the caller may replace a core's output
    before taking the next."""
    for cat in list(graph.nodes):
        if not (is_op(cat, aten.cat.default) and arg(cat, 1, "dim", 0) in (-1, 2)):
            continue
        *score_nodes, sink_node = cat.args[0]
        if not (is_op(sink_node, aten.expand.default) and is_op(sink_node.args[0], *RESHAPES)):
            continue
        parts = [_score_part(n) for n in score_nodes]
        if not parts or any(p is None for p in parts):
            continue
        q = parts[0][0]
        scale = parts[0][3]
        if any(p[0] is not q or p[3] != scale for p in parts):
            continue
        probs = _softmax_of(cat)
        out = _output_of(probs, [p[1] for p in parts]) if probs is not None else None
        if out is None:
            continue
        sink = strip(sink_node.args[0].args[0])
        yield AttentionCore(out, q, [p[1] for p in parts], [p[2] for p in parts], sink, scale)


def fuse_sink_attention(graph: torch.fx.Graph) -> int:
    """Replace each attention core with ``sink_attention``; returns the number replaced."""
    count = 0
    for core in attention_cores(graph):
        replace_output(
            graph,
            core.out,
            torch.ops.deepinfer.sink_attention.default,
            (core.q, core.kvs, core.visibles, core.sink, core.scale),
        )
        count += 1
    return count
