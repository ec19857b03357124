"""Comparing parameter gradients with transformers when the two name and pack parameters
differently (transformers fuses V4's gate/up experts into one 3D tensor, renames every
projection): rows are matched by value. Both models load the same checkpoint in fp32, so
every row (the last dimension of a parameter) of a transformers parameter equals, bit for
bit, one row of one of our parameters; random tiny weights make each row unique."""

from __future__ import annotations

import torch
from torch import nn


def _row_index(model: nn.Module) -> dict[tuple[int, bytes], tuple[str, int]]:
    """(row width, row bytes) -> (our parameter name, row number)."""
    index: dict[tuple[int, bytes], tuple[str, int]] = {}
    for name, p in model.named_parameters():
        rows = p.detach().reshape(-1, p.shape[-1]) if p.dim() else p.detach().reshape(1, 1)
        for r, row in enumerate(rows):
            key = (row.shape[0], row.numpy().tobytes())
            index[key] = (name, r) if key not in index else ("<ambiguous>", -1)
    return index


def matched_gradients(ours: nn.Module, theirs: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """For every transformers parameter with a gradient: (its name, our gradient rows laid
    out as its rows, its gradient rows). Raises when a row has no unique match."""
    index = _row_index(ours)
    params = dict(ours.named_parameters())
    out = []
    for name, p in theirs.named_parameters():
        if p.grad is None:
            continue
        same = params.get(name)
        if same is not None and same.shape == p.shape and torch.equal(same.detach(), p.detach()):
            # the same name and values (Llama's layout): no row search, which repeated rows
            # (a quantized embedding's identical unused tokens) would make ambiguous
            grad = same.grad if same.grad is not None else torch.zeros_like(same)
            out.append((name, grad, p.grad))
            continue
        rows = p.detach().reshape(-1, p.shape[-1]) if p.dim() else p.detach().reshape(1, 1)
        mine = []
        for row in rows:
            where = index.get((row.shape[0], row.numpy().tobytes()))
            if where is None or where[0] == "<ambiguous>":
                raise AssertionError(
                    f"transformers parameter {name}: a row matches no unique parameter of ours"
                )
            q = params[where[0]]
            grad = q.grad if q.grad is not None else torch.zeros_like(q)
            mine.append(grad.reshape(-1, q.shape[-1])[where[1]] if q.dim() else grad.reshape(1))
        out.append((name, torch.stack(mine), p.grad.reshape(rows.shape)))
    return out


def covered_parameters(ours: nn.Module, theirs: nn.Module) -> set[str]:
    """Our parameters some row of which a transformers parameter holds (or that it holds
    under the same name)."""
    index = _row_index(ours)
    mine = dict(ours.named_parameters())
    names = set()
    for name, p in theirs.named_parameters():
        if name in mine and mine[name].shape == p.shape and torch.equal(mine[name].detach(), p.detach()):
            names.add(name)
            continue
        rows = p.detach().reshape(-1, p.shape[-1]) if p.dim() else p.detach().reshape(1, 1)
        for row in rows:
            where = index.get((row.shape[0], row.numpy().tobytes()))
            if where is not None:
                names.add(where[0])
    return names
