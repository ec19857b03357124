"""KV compressor (V4 with ``ape`` and overlap, V4.1 without).

Every ``ratio`` source tokens become one compressed entry: a per-channel softmax over the
group's gate scores (V4 adds the learned absolute position bias ``ape``) weights the group's
projected vectors. With ``overlap`` (V4's CSA compressor) each token projects two series:
entry ``w`` pools the previous group's first half with group ``w``'s second half over
``2 * ratio`` slots. V4.1's ratio-1 compressor has no gate: the entry is the token's own
projection. Incomplete groups wait in per-sequence buffers until they fill.

The projections run in the weights' dtype (V4.1 keeps the pooling compressor in fp32). An
eager step off the CPU (no autograd, a state-keeping binding) runs the state writes and the
pooling as ``deepinfer::compress_groups`` (``kernels/compressor_triton.py``: two launches on
CUDA); CPU steps, compiled steps, autograd and ``batch_invariant`` keep the plain form below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.cache.forward_batch import CompressorPools, ForwardBatch, GroupMeta
from deepinfer.kernels import compressor_triton
from deepinfer.models.layers.fused_ops import runs_fused
from deepinfer.models.layers.gather import gather_rows
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
        position_bias: bool = True,
    ) -> None:
        super().__init__()
        width = out_dim * (2 if overlap else 1)
        self.ratio, self.out_dim, self.overlap, self.width = ratio, out_dim, overlap, width
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False) if ratio > 1 or position_bias else None
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32)) if position_bias else None
        self.norm = RMSNorm(out_dim, eps)
        self.rotary = rotary
        self.quantize = quantize  # QAT fake-quant of emitted entries (None: off)

    def forward(
        self, x: torch.Tensor, pools: CompressorPools, meta: GroupMeta, out: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Consume this step's tokens ``x`` [T, d]; write closed groups' entries into ``out``.

        Returns the closed groups' latents [G, D] before RoPE and fake-quant (V4.1's indexer
        derives its keys from them; None when no group closed) and the entries tensor to
        read (``out``, or its functional copy). The functional binding keeps no state for a
        later step, so it skips the state writes.
        """
        xw = x.to(self.wkv.weight.dtype)
        kv = self.wkv(xw)
        if self.wgate is None:  # ratio 1: every token is its own group, always in this chunk
            if not meta.group_rows.shape[0]:
                return None, out
            return self._emit(kv[meta.group_rows[:, 0]], x.dtype, meta, out, batch)
        gate = self.wgate(xw)
        keeps_state = not batch.functional
        if keeps_state and runs_fused(kv, gate):
            return self._fused_step(kv, gate, x.dtype, pools, meta, out, batch)
        if keeps_state and self.overlap and meta.restore_dst.numel():
            # row writes as index_copy_ (the rows are distinct but for padding's null row);
            # compilation.inductor_options says why compiled steps keep them in place
            pools.ovl_kv.index_copy_(0, meta.restore_dst, pools.snap_kv[meta.restore_src])
            pools.ovl_gate.index_copy_(0, meta.restore_dst, pools.snap_gate[meta.restore_src])
        src_kv = [kv, pools.buf_kv[meta.src_buf_rows]]
        src_gate = [gate, pools.buf_gate[meta.src_buf_rows]]
        if self.overlap:
            src_kv.append(pools.ovl_kv[meta.src_ovl_rows])
            src_gate.append(pools.ovl_gate[meta.src_ovl_rows])
        src_kv_t, src_gate_t = torch.cat(src_kv), torch.cat(src_gate).float()

        latent = None
        if meta.group_rows.shape[0]:
            group_kv = gather_rows(src_kv_t, meta.group_rows)  # [G, r, width]
            group_gate = gather_rows(src_gate_t, meta.group_rows)
            if self.ape is not None:
                group_gate = group_gate + self.ape
            if self.overlap:
                group_kv, group_gate = self._overlap_slots(group_kv, group_gate, src_kv_t, src_gate_t, meta)
            weights = group_gate.softmax(dim=1, dtype=torch.float32).to(group_kv.dtype)
            latent, out = self._emit((group_kv * weights).sum(dim=1), x.dtype, meta, out, batch)
        if not keeps_state:
            return latent, out

        # Read every state row we need before writing any (a slot's rows can be both).
        new_ovl = (src_kv_t[meta.ovl_src], src_gate_t[meta.ovl_src]) if self.overlap else None
        new_snap = (src_kv_t[meta.snap_src], src_gate_t[meta.snap_src]) if self.overlap else None
        pools.buf_kv.index_copy_(0, meta.buf_dst, kv[meta.buf_src].to(pools.buf_kv.dtype))
        pools.buf_gate.index_copy_(0, meta.buf_dst, gate[meta.buf_src].to(pools.buf_gate.dtype))
        if new_ovl is not None and new_snap is not None:
            pools.ovl_kv.index_copy_(0, meta.ovl_dst, new_ovl[0].to(pools.ovl_kv.dtype))
            pools.ovl_gate.index_copy_(0, meta.ovl_dst, new_ovl[1].to(pools.ovl_gate.dtype))
            pools.snap_kv.index_copy_(0, meta.snap_dst, new_snap[0].to(pools.snap_kv.dtype))
            pools.snap_gate.index_copy_(0, meta.snap_dst, new_snap[1].to(pools.snap_gate.dtype))
        return latent, out

    def _fused_step(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        dtype: torch.dtype,
        pools: CompressorPools,
        meta: GroupMeta,
        out: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The state writes and pooling as ``deepinfer::compress_groups`` (two launches on
        CUDA), then the closed groups' entries as the plain path makes them."""
        rows = [
            meta.src_buf_rows,
            meta.src_ovl_rows,
            meta.group_rows,
            meta.prev_rows,
            meta.buf_src,
            meta.buf_dst,
            meta.ovl_src,
            meta.ovl_dst,
            meta.snap_src,
            meta.snap_dst,
            meta.restore_src,
            meta.restore_dst,
        ]
        overlap = (
            (pools.ovl_kv, pools.ovl_gate, pools.snap_kv, pools.snap_gate) if self.overlap else (None,) * 4
        )
        pooled = compressor_triton.compress_groups(
            kv, gate, self.ape, pools.buf_kv, pools.buf_gate, *overlap, rows
        )
        if not meta.group_rows.shape[0]:
            return None, out
        return self._emit(pooled, dtype, meta, out, batch)

    def _emit(
        self,
        pooled: torch.Tensor,
        dtype: torch.dtype,
        meta: GroupMeta,
        out: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise the pooled groups, rotate each at its first position, fake-quantise, store;
        return the latent before RoPE and the entries to read."""
        latent = self.norm(pooled.to(dtype))
        cos, sin = self.rotary(meta.group_pos)
        raw = apply_rope(latent, cos, sin)
        entry = self.quantize(raw) if self.quantize is not None else raw
        return latent, batch.write(out, meta.entry_slot, entry, raw=raw)

    def _overlap_slots(
        self,
        group_kv: torch.Tensor,
        group_gate: torch.Tensor,
        src_kv: torch.Tensor,
        src_gate: torch.Tensor,
        meta: GroupMeta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[previous group's first half ; this group's second half]`` over 2r slots."""
        d = self.out_dim
        has_prev = (meta.prev_rows >= 0).unsqueeze(-1)  # [G, r, 1]
        prev = meta.prev_rows.clamp(min=0)
        prev_kv = torch.where(has_prev, gather_rows(src_kv, prev)[..., :d], 0.0).to(group_kv.dtype)
        prev_gate = gather_rows(src_gate, prev)[..., :d]
        if self.ape is not None:
            prev_gate = prev_gate + self.ape[:, :d]
        prev_gate = torch.where(has_prev, prev_gate, float("-inf"))
        slots_kv = torch.cat([prev_kv, group_kv[..., d:]], dim=1)
        slots_gate = torch.cat([prev_gate, group_gate[..., d:]], dim=1)
        return slots_kv, slots_gate
