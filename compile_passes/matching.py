"""Small helpers for hand-written matchers over Inductor's post-grad (ATen) graphs.

A matcher starts from an anchor node and walks to its producers, checking each op; a walk
that meets anything unexpected returns None and the subgraph is left alone (a missed match
costs speed, never correctness). ``strip`` looks through dtype casts and no-op views."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims

_TRANSPARENT = {prims.convert_element_type.default}


# the reshaping ops a post-grad graph holds for one view of a tensor
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def strip(node: Any) -> Any:
    """The node behind any chain of dtype casts."""
    while is_op(node, *_TRANSPARENT):
        node = node.args[0]
    return node


def arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument ``i``/``name`` of an ATen call."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def users_of(node: Node, *targets) -> list[Node]:
    return [u for u in node.users if is_op(u, *targets)]


def val(node: Any):
    """The fake value a node carries (shape and dtype), or None."""
    return node.meta.get("val") if isinstance(node, Node) else None


def replace_output(graph: torch.fx.Graph, old: Node, target, args: tuple, before: Node | None = None) -> Node:
    """Insert ``target(*args)`` before ``before`` (default ``old``), hand it ``old``'s users and
    fake value, and drop the nodes that became dead."""
    with graph.inserting_before(before or old):
        new = graph.call_function(target, args)
    new.meta["val"] = old.meta.get("val")
    old.replace_all_uses_with(new)
    graph.eliminate_dead_code()
    return new


def earliest_point(graph: torch.fx.Graph, nodes: list[Node]) -> Node:
    """The first node after every node of ``nodes`` (where a replacement may read them)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(nodes, key=lambda n: order[n])
    return last.next
