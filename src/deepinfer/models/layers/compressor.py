"""KV compressor (model_spec.md §2.4, V4 variant with ``ape`` and overlap).

Every ``ratio`` source tokens become one compressed entry: a per-channel softmax over the
group's gate scores (plus the learned absolute position bias ``ape``) weights the group's
projected vectors. With ``overlap`` (the CSA compressor) each token projects two series:
entry ``w`` pools the previous window's first half with window ``w``'s second half over
``2 * ratio`` slots. Incomplete groups wait in the state until they fill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.models.forward_batch import CompressorState
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary, apply_rope


class Compressor(nn.Module):
    def __init__(
        self,
        hidden: int,
        out_dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        rotary: Rotary,
        quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        width = out_dim * (2 if overlap else 1)
        self.ratio, self.out_dim, self.overlap = ratio, out_dim, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(out_dim, eps)
        self.rotary = rotary
        self.quantize = quantize  # QAT fake-quant of emitted entries (None: off)

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Consume ``x`` [B, S, d]; return all entries emitted so far [B, T, out_dim]."""
        b = x.shape[0]
        kv, gate = self.wkv(x), self.wgate(x)
        if state.buffer_kv is not None:
            kv = torch.cat([state.buffer_kv, kv], dim=1)
            gate = torch.cat([state.buffer_gate, gate], dim=1)
        r = self.ratio
        usable = (kv.shape[1] // r) * r
        state.buffer_kv, state.buffer_gate = kv[:, usable:], gate[:, usable:]
        if usable == 0:
            if state.entries is None:
                state.entries = x.new_zeros(b, 0, self.out_dim)
            return state.entries

        n_win = usable // r
        kv = kv[:, :usable].view(b, n_win, r, -1)
        gate = gate[:, :usable].view(b, n_win, r, -1) + self.ape
        if self.overlap:
            kv, gate = self._overlap_slots(kv, gate, state)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        pooled = self.norm((kv * weights).sum(dim=2))
        first = state.emitted * r
        positions = torch.arange(n_win, device=x.device) * r + first
        cos, sin = self.rotary(positions)
        pooled = apply_rope(pooled, cos, sin)
        if self.quantize is not None:
            pooled = self.quantize(pooled)
        state.entries = pooled if state.entries is None else torch.cat([state.entries, pooled], dim=1)
        state.emitted += n_win
        return state.entries

    def _overlap_slots(
        self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay out ``[prev window's first half ; this window's second half]`` over 2r slots."""
        b, n_win, r, _ = kv.shape
        d = self.out_dim
        slots_kv = kv.new_zeros(b, n_win, 2 * r, d)
        slots_gate = gate.new_full((b, n_win, 2 * r, d), float("-inf"))
        slots_kv[:, :, r:] = kv[..., d:]
        slots_gate[:, :, r:] = gate[..., d:]
        slots_kv[:, 1:, :r] = kv[:, :-1, :, :d]
        slots_gate[:, 1:, :r] = gate[:, :-1, :, :d]
        if state.overlap_kv is not None:
            slots_kv[:, 0, :r] = state.overlap_kv
            slots_gate[:, 0, :r] = state.overlap_gate
        state.overlap_kv = kv[:, -1, :, :d].clone()
        state.overlap_gate = gate[:, -1, :, :d].clone()
        return slots_kv, slots_gate
