"""A projection's served-adapter terms as one op a compiled step keeps: ``deepinfer::lora_add``.

The eager step groups a step's adapter rows by slot on the host (``models/layers/lora.py``);
a compiled step cannot branch on those groups, so it hands each row's slot as a tensor to this
op instead. Its default form needs no host read: every row is shrunk by every slot's A at
once, the columns of slots other than the row's own are zeroed, and the expand multiplies by
every slot's B (a step computes its rows against all ``max_loras`` slots, a few hundred
columns). On the CPU the op groups the rows itself and runs the grouped kernel the eager step
runs (``kernels/cpu/lora.cpp``), so compiled and eager steps add the same terms.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.cpu import lora as cpu_lora


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_rows: torch.Tensor,
    a: torch.Tensor,
    bs: list[torch.Tensor],
    rank: int,
) -> torch.Tensor:
    """y [T, sum outs] plus row t's term from slot ``slot_rows[t]`` (-1: none); ``a`` [S, in,
    n R] (the linears' A side by side), ``bs[j]`` [S, R, out_j]."""
    slots = a.shape[0]
    mine = (slot_rows.unsqueeze(1) == torch.arange(slots, device=slot_rows.device)).to(x.dtype)
    shrunk = torch.einsum("ti,sir->tsr", x, a) * mine.unsqueeze(-1)
    terms = [torch.einsum("tsr,sro->to", shrunk[..., j * rank : (j + 1) * rank], b) for j, b in enumerate(bs)]
    return y + torch.cat(terms, dim=-1)


# the op's default kernel is ``reference`` itself (every device but the CPU)
lora_add = torch.library.custom_op("deepinfer::lora_add", mutates_args=())(reference)


@lora_add.register_fake
def _(y, x, slot_rows, a, bs, rank):
    return torch.empty_like(y)


@lora_add.register_kernel("cpu")
def _cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_rows: torch.Tensor,
    a: torch.Tensor,
    bs: list[torch.Tensor],
    rank: int,
) -> torch.Tensor:
    out = y.clone()
    x = x.contiguous()
    if not cpu_lora.supports(x, out):
        return reference(y, x, slot_rows, a, bs, rank)
    rows = (slot_rows >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return out
    row_slots = slot_rows[rows]
    order = torch.argsort(row_slots, stable=True)
    rows, row_slots = rows[order].contiguous(), row_slots[order]
    group_slots, counts = torch.unique_consecutive(row_slots, return_counts=True)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    matrices = cpu_lora.Matrices(a, list(bs), rank)
    return cpu_lora.sgmv(out, x, rows, group_slots.contiguous(), starts.contiguous(), matrices)
