"""Attention cores whose keys are pool gathers -> ``deepinfer::sink_attention_rows_cpu`` (CPU).

The plain model gathers each part's keys, ``pool.index_select(0, idx.reshape(-1))`` viewed
as [T, L, D] (``models/layers/gather.py``), then attends over them (``attention_with_sink``).
Here each such core with one or two parts whose keys are all gathers of a 2-D fp32 pool is
replaced by the C++ op that reads the pool rows through the indices itself
(``kernels/sink_attention_rows.py``), so no gathered copy is made. A core with another part
(a packed pool's decode, another dtype's conversion) keeps Inductor's own code. Runs before
``reduce_small_bmm``, which rewrites the cores' ``bmm``s."""

from __future__ import annotations

import torch
from deepinfer.compile_passes.attention import attention_cores
from deepinfer.compile_passes.matching import RESHAPES, aten, is_op, replace_output, val
from deepinfer.kernels import rope as _rope  # noqa: F401  (registers deepinfer::rope)
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

_ROPES = (torch.ops.deepinfer.rope.default,)  # the RoPE calls folded into the op
# sink_attention_rows_cpu's argument positions of the queries' and the output's RoPE tables
_Q_TABLES, _OUT_TABLES = slice(9, 11), slice(11, 13)


def _pool_rows(kv: Node) -> tuple[Node, Node] | None:
    """(pool [N, D], idx [T, L]) where ``kv`` is ``view(pool[view(idx, [-1])], [T, L, D])``
    (the gather as ``index.Tensor`` or ``index_select``) of an fp32 CPU pool; else None."""
    if not is_op(kv, *RESHAPES):
        return None
    gathered = kv.args[0]
    if is_op(gathered, aten.index.Tensor):
        pool, indices = gathered.args[:2]
        if len(indices) != 1 or indices[0] is None:
            return None
        flat = indices[0]
    elif is_op(gathered, aten.index_select.default) and gathered.args[1] == 0:
        pool, flat = gathered.args[0], gathered.args[2]
    else:
        return None
    if not (is_op(flat, *RESHAPES) and list(flat.args[1]) == [-1]):
        return None
    idx = flat.args[0]
    pool_val, idx_val, kv_val = val(pool), val(idx), val(kv)
    if pool_val is None or idx_val is None or kv_val is None:
        return None
    if pool_val.dim() != 2 or pool_val.dtype != torch.float32 or pool_val.device.type != "cpu":
        return None
    if idx_val.dim() != 2 or idx_val.dtype != torch.long or kv_val.dim() != 3:
        return None
    same = zip(kv_val.shape, (*idx_val.shape, pool_val.shape[1]), strict=True)
    if not all(statically_known_true(a == b) for a, b in same):
        return None
    return pool, idx


def use_row_sink_attention(graph: torch.fx.Graph) -> int:
    """Replace each attention core over one or two gathered fp32 parts with
    ``sink_attention_rows_cpu``; returns how many."""
    from deepinfer.kernels.cpu import step_ops as cpu_step_ops

    if not cpu_step_ops.available():  # the op is not registered in this process
        return 0
    count = 0
    for core in attention_cores(graph):
        q = val(core.q)
        if q is None or q.dtype != torch.float32 or q.device.type != "cpu" or len(core.kvs) not in (1, 2):
            continue
        parts = [_pool_rows(kv) for kv in core.kvs]
        if any(p is None for p in parts):
            continue
        args: list[object] = [core.q]
        for (pool, idx), visible in zip(parts, core.visibles, strict=True):  # type: ignore[misc]
            args += [pool, idx, visible]
        args += [None] * (3 * (2 - len(parts)))
        args += [core.sink, core.scale]
        op = replace_output(graph, core.out, torch.ops.deepinfer.sink_attention_rows_cpu.default, tuple(args))
        _fuse_rope(graph, op)
        count += 1
    return count


def _rope_tables(node: Node) -> tuple[Node, Node] | None:
    """(cos, sin) of a RoPE call whose tables are one row per token, [T, 1, half] (broadcast
    over the heads, as the kernel takes them; their T is the positions' symbol, equal to the
    rows' at run time, which the kernel checks, handing any other shape to the formula);
    else None."""
    if not is_op(node, *_ROPES):
        return None
    cos, sin = node.args[1:3]
    x, c, s = val(node.args[0]), val(cos), val(sin)
    if x is None or c is None or s is None or c.dim() != 3 or x.dim() != 3 or c.shape != s.shape:
        return None
    if not statically_known_true(c.shape[1] == 1):
        return None
    if c.dtype != torch.float32 or s.dtype != torch.float32:
        return None
    return cos, sin


def _fuse_rope(graph: torch.fx.Graph, op: Node) -> None:
    """Fold the queries' RoPE (when nothing else reads the rotated queries) and the output's
    de-rotation (when it is the op's only reader) into ``op``: each was a call copying the
    whole [T, H, D] tensor to rotate its last channels (22 calls a tiny-V4 step)."""
    args = list(op.args) + [None] * 4
    q = op.args[0]
    tables = _rope_tables(q)
    if tables is not None and len(q.users) == 1:
        args[0] = q.args[0]
        args[_Q_TABLES] = tables
    users = list(op.users)
    out_rope = users[0] if len(users) == 1 and users[0].args[0] is op else None
    tables = _rope_tables(out_rope) if out_rope is not None else None
    if tables is not None:
        args[_OUT_TABLES] = tables
    if args[_Q_TABLES.start] is None and args[_OUT_TABLES.start] is None:
        return
    op.args = tuple(args)
    if tables is not None:
        out_rope.prepend(op)  # after the de-rotation's tables (its inputs all come earlier)
        out_rope.replace_all_uses_with(op)
    graph.eliminate_dead_code()
