"""Weight projections of a CPU step -> ``deepinfer::packed_linear`` (CPU only).

``F.linear(x, W)`` reaches the post-grad graph as ``mm(x, permute(W, [1, 0]))`` (``addmm``
with a bias) with ``W`` a graph input (the step's parameters are inputs, so one compiled step serves any checkpoint).
The rewrite sends each such fp32 product to the C++ op of ``kernels/cpu/linear_op.py``, which
multiplies on the packed copy the engine registered for ``W`` (half of MKL's time on the tiny
V4's projections) and is ``aten::mm`` for a ``W`` it has none of, so a match the engine did not
pack for costs one dispatch, never correctness. Products of two activations (no input behind
the transpose) keep their ``mm``. Installed only where the op built."""

from __future__ import annotations

import torch
from deepinfer.compile_passes.matching import aten, is_op, val


def use_packed_linear(graph: torch.fx.Graph) -> int:
    """Rewrite each ``mm(x, permute(input, [1, 0]))`` of 2-D fp32 tensors, and each
    ``addmm(b, x, permute(input, [1, 0]))`` with unit scales: a 1-D fp32 ``b`` is the op's
    bias, a 2-D one (a residual add Inductor folded into the product) an ``add`` after it,
    which Inductor fuses with what follows; returns how many."""
    from deepinfer.kernels.cpu import linear_op as cpu_linear_op

    if not cpu_linear_op.available():  # the op is not registered in this process
        return 0
    count = 0
    for node in list(graph.nodes):
        bias = addend = None
        if is_op(node, aten.addmm.default) and not node.kwargs and len(node.args) == 3:
            bias, x, transposed = node.args
            b_val, out_val = val(bias), val(node)
            if b_val is None or out_val is None or b_val.dtype != torch.float32:
                continue
            if b_val.dim() == 2:  # an addend of the product's shape (a fused residual add)
                if tuple(b_val.shape) != tuple(out_val.shape):
                    continue
                bias, addend = None, bias
            elif b_val.dim() != 1:
                continue
        elif is_op(node, aten.mm.default):
            x, transposed = node.args[:2]
        else:
            continue
        if not is_op(transposed, aten.permute.default) or list(transposed.args[1]) != [1, 0]:
            continue
        weight = transposed.args[0]
        if not (isinstance(weight, torch.fx.Node) and weight.op == "placeholder"):
            continue
        x_val, w_val = val(x), val(weight)
        if x_val is None or w_val is None or x_val.dim() != 2 or w_val.dim() != 2:
            continue
        if x_val.dtype != torch.float32 or w_val.dtype != torch.float32 or x_val.device.type != "cpu":
            continue
        args = (x, weight) if bias is None else (x, weight, bias)
        with graph.inserting_before(node):
            linear = graph.call_function(torch.ops.deepinfer.packed_linear.default, args)
            result = linear if addend is None else graph.call_function(aten.add.Tensor, (linear, addend))
        linear.meta["val"] = node.meta.get("val")
        result.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not transposed.users:
            graph.erase_node(transposed)
        count += 1
    return count
