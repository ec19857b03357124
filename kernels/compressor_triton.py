"""A V4 compressor's step as two launches on CUDA: ``deepinfer::compress_groups``, with two
Triton kernels.

In eager PyTorch a gated compressor's step (``models/layers/compressor.py``) is some forty
launches: the snapshot restores, the gathers and cat of its source rows (this step's tokens,
the partial-group buffer, CSA's overlap), the gathers, masks and cat of the closed groups'
slots, the softmax and weighted sum, and the state writes (buffer, overlap, snapshot rows).
Here ``_sources`` builds the source rows in one launch (reading a restored overlap row from
its snapshot, while other programs write the restores), and ``_pool_and_write`` pools each
closed group (one program per group) and writes the new state rows from those sources (one
program per row): the state it overwrites is read only by the first launch, so no program
reads what another writes.

The op's default implementation is the compressor's plain math (``reference``), which every
device without the kernels runs. The kernels are defined at the first CUDA call, so CPU-only
machines never import Triton; they also run under ``TRITON_INTERPRET=1`` on CPU tensors (the
CPU tests). The pooled sums match the plain math to rounding (another summation order and
exponential), the state rows bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepinfer.kernels.triton_support import triton_installed

# Most snapshot restores one launch looks up per overlap row (registers).
MAX_RESTORES = 1024
# Most slots of one group (2 * ratio with overlap) one program holds (registers).
MAX_SLOTS = 256


def sources(
    kv: torch.Tensor,
    gate: torch.Tensor,
    buf_kv: torch.Tensor,
    buf_gate: torch.Tensor,
    ovl_kv: torch.Tensor | None,
    ovl_gate: torch.Tensor | None,
    src_buf_rows: torch.Tensor,
    src_ovl_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's source rows: cat(tokens, buffer rows, overlap rows); gates in fp32."""
    src_kv, src_gate = [kv, buf_kv[src_buf_rows]], [gate, buf_gate[src_buf_rows]]
    if ovl_kv is not None and ovl_gate is not None:
        src_kv.append(ovl_kv[src_ovl_rows])
        src_gate.append(ovl_gate[src_ovl_rows])
    return torch.cat(src_kv), torch.cat(src_gate).float()


def pool(
    src_kv: torch.Tensor,
    src_gate: torch.Tensor,
    group_rows: torch.Tensor,
    prev_rows: torch.Tensor,
    ape: torch.Tensor | None,
    overlap: bool,
) -> torch.Tensor:
    """Each closed group's gated sum [G, d]: a per-channel softmax over its slots (with
    ``overlap``, the previous group's first half then this group's second half)."""
    group_kv = src_kv.index_select(0, group_rows.reshape(-1)).view(*group_rows.shape, src_kv.shape[-1])
    group_gate = src_gate.index_select(0, group_rows.reshape(-1)).view(*group_rows.shape, src_gate.shape[-1])
    if ape is not None:
        group_gate = group_gate + ape
    if overlap:
        d = src_kv.shape[-1] // 2
        has_prev = (prev_rows >= 0).unsqueeze(-1)
        prev = prev_rows.clamp(min=0).reshape(-1)
        prev_kv = src_kv.index_select(0, prev).view(*prev_rows.shape, src_kv.shape[-1])[..., :d]
        prev_kv = torch.where(has_prev, prev_kv, 0.0).to(group_kv.dtype)
        prev_gate = src_gate.index_select(0, prev).view(*prev_rows.shape, src_gate.shape[-1])[..., :d]
        if ape is not None:
            prev_gate = prev_gate + ape[:, :d]
        prev_gate = torch.where(has_prev, prev_gate, float("-inf"))
        group_kv = torch.cat([prev_kv, group_kv[..., d:]], dim=1)
        group_gate = torch.cat([prev_gate, group_gate[..., d:]], dim=1)
    weights = group_gate.softmax(dim=1, dtype=torch.float32).to(group_kv.dtype)
    return (group_kv * weights).sum(dim=1)


def reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor | None,
    buf_kv: torch.Tensor,
    buf_gate: torch.Tensor,
    ovl_kv: torch.Tensor | None,
    ovl_gate: torch.Tensor | None,
    snap_kv: torch.Tensor | None,
    snap_gate: torch.Tensor | None,
    rows: list[torch.Tensor],
) -> torch.Tensor:
    """The compressor's plain step: restore, sources, pooling, then the state writes."""
    src_buf, src_ovl, group, prev, buf_src, buf_dst, ovl_src, ovl_dst, snap_src, snap_dst, r_src, r_dst = rows
    overlap = ovl_kv is not None and ovl_gate is not None and snap_kv is not None and snap_gate is not None
    if overlap:
        ovl_kv.index_copy_(0, r_dst, snap_kv[r_src])
        ovl_gate.index_copy_(0, r_dst, snap_gate[r_src])
    src_kv, src_gate = sources(kv, gate, buf_kv, buf_gate, ovl_kv, ovl_gate, src_buf, src_ovl)
    pooled = pool(src_kv, src_gate, group, prev, ape, overlap)
    buf_kv.index_copy_(0, buf_dst, kv[buf_src].to(buf_kv.dtype))
    buf_gate.index_copy_(0, buf_dst, gate[buf_src].to(buf_gate.dtype))
    if overlap:
        ovl_kv.index_copy_(0, ovl_dst, src_kv[ovl_src].to(ovl_kv.dtype))
        ovl_gate.index_copy_(0, ovl_dst, src_gate[ovl_src].to(ovl_gate.dtype))
        snap_kv.index_copy_(0, snap_dst, src_kv[snap_src].to(snap_kv.dtype))
        snap_gate.index_copy_(0, snap_dst, src_gate[snap_src].to(snap_gate.dtype))
    return pooled


@torch.library.custom_op(
    "deepinfer::compress_groups",
    mutates_args=("buf_kv", "buf_gate", "ovl_kv", "ovl_gate", "snap_kv", "snap_gate"),
)
def compress_groups(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor | None,
    buf_kv: torch.Tensor,
    buf_gate: torch.Tensor,
    ovl_kv: torch.Tensor | None,
    ovl_gate: torch.Tensor | None,
    snap_kv: torch.Tensor | None,
    snap_gate: torch.Tensor | None,
    rows: list[torch.Tensor],
) -> torch.Tensor:
    """``kv``/``gate`` [T, width] of this step's tokens; the state pools (overlap and snapshot
    pools None without overlap); ``rows``: ``GroupMeta``'s src_buf_rows, src_ovl_rows,
    group_rows, prev_rows, buf_src, buf_dst, ovl_src, ovl_dst, snap_src, snap_dst, restore_src,
    restore_dst. Writes the state; returns the closed groups' pooled [G, width or width / 2]
    (the source rows' dtype)."""
    return reference(kv, gate, ape, buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate, rows)


@compress_groups.register_fake
def _(kv, gate, ape, buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate, rows):
    d = kv.shape[-1] // (2 if ovl_kv is not None else 1)
    return kv.new_empty(rows[2].shape[0], d, dtype=torch.promote_types(kv.dtype, buf_kv.dtype))


def takes(
    kv: torch.Tensor,
    gate: torch.Tensor,
    buf_kv: torch.Tensor,
    ovl_kv: torch.Tensor | None,
    snap_kv: torch.Tensor | None,
    rows: list[torch.Tensor],
) -> bool:
    """Triton installed; float rows of one width with unit channel stride; contiguous fp32 or
    same-dtype state; every overlap pool or none; few enough restores and slots."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if not (triton_installed() and kv.dtype in floats and gate.dtype in floats and kv.dim() == 2):
        return False
    if kv.stride(-1) != 1 or gate.stride(-1) != 1 or gate.shape != kv.shape:
        return False
    if (ovl_kv is None) != (snap_kv is None):
        return False
    slots = rows[2].shape[1] * (2 if ovl_kv is not None else 1)
    return rows[-1].numel() <= MAX_RESTORES and slots <= MAX_SLOTS and buf_kv.shape[-1] == kv.shape[-1]


@compress_groups.register_kernel("cuda")
def _cuda(kv, gate, ape, buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate, rows) -> torch.Tensor:
    pools = [p for p in (buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate) if p is not None]
    if takes(kv, gate, buf_kv, ovl_kv, snap_kv, rows) and all(p.is_contiguous() for p in pools):
        return compress_triton(kv, gate, ape, buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate, rows)
    return reference(kv, gate, ape, buf_kv, buf_gate, ovl_kv, ovl_gate, snap_kv, snap_gate, rows)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_row(src_kv, src_gate, dst_kv, dst_gate, width, BLOCK: tl.constexpr):
        for start in range(0, width, BLOCK):
            c = start + tl.arange(0, BLOCK)
            ok = c < width
            tl.store(dst_kv + c, tl.load(src_kv + c, mask=ok).to(dst_kv.dtype.element_ty), mask=ok)
            tl.store(dst_gate + c, tl.load(src_gate + c, mask=ok).to(dst_gate.dtype.element_ty), mask=ok)

    # Triton finds a kernel's callees among its module's globals, not in this closure
    globals()["_copy_row"] = _copy_row

    @triton.jit
    def _sources(
        kv_ptr,
        gate_ptr,
        buf_kv,
        buf_gate,
        ovl_kv,
        ovl_gate,
        snap_kv,
        snap_gate,
        src_buf_rows,
        src_ovl_rows,
        restore_src,
        restore_dst,
        out_kv,
        out_gate,
        kv_stride,
        gate_stride,
        tokens,
        n_buf,
        n_ovl,
        n_restore,
        width,
        BLOCK: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        n_src = tokens + n_buf + n_ovl
        if i < tokens:  # this step's token
            _copy_row(
                kv_ptr + i * kv_stride,
                gate_ptr + i * gate_stride,
                out_kv + i * width,
                out_gate + i * width,
                width,
                BLOCK,
            )
        elif i < tokens + n_buf:  # a buffered row
            row = tl.load(src_buf_rows + (i - tokens)).to(tl.int64)
            _copy_row(
                buf_kv + row * width,
                buf_gate + row * width,
                out_kv + i * width,
                out_gate + i * width,
                width,
                BLOCK,
            )
        elif i < n_src:  # an overlap row, from its snapshot where one is restored into it
            row = tl.load(src_ovl_rows + (i - tokens - n_buf)).to(tl.int64)
            k = tl.arange(0, BLOCK_R)
            dst = tl.load(restore_dst + k, mask=k < n_restore, other=-1)
            last = tl.max(tl.where(dst == row, k, -1), axis=0)  # index_copy_'s last write wins
            if last >= 0:
                snap = tl.load(restore_src + last).to(tl.int64)
                _copy_row(
                    snap_kv + snap * width,
                    snap_gate + snap * width,
                    out_kv + i * width,
                    out_gate + i * width,
                    width,
                    BLOCK,
                )
            else:
                _copy_row(
                    ovl_kv + row * width,
                    ovl_gate + row * width,
                    out_kv + i * width,
                    out_gate + i * width,
                    width,
                    BLOCK,
                )
        else:  # a restore: snapshot row -> overlap row (read above only through the snapshot)
            k = i - n_src
            snap = tl.load(restore_src + k).to(tl.int64)
            row = tl.load(restore_dst + k).to(tl.int64)
            _copy_row(
                snap_kv + snap * width,
                snap_gate + snap * width,
                ovl_kv + row * width,
                ovl_gate + row * width,
                width,
                BLOCK,
            )

    @triton.jit
    def _pool_and_write(
        src_kv,
        src_gate,
        group_rows,
        prev_rows,
        ape_ptr,
        out_ptr,
        buf_kv,
        buf_gate,
        ovl_kv,
        ovl_gate,
        snap_kv,
        snap_gate,
        buf_src,
        buf_dst,
        ovl_src,
        ovl_dst,
        snap_src,
        snap_dst,
        groups,
        ratio,
        d,
        width,
        n_buf,
        n_ovl,
        n_snap,
        OVERLAP: tl.constexpr,
        HAS_APE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        p = tl.program_id(0).to(tl.int64)
        if p < groups:  # pool group p: a softmax over its slots per channel
            j = tl.arange(0, BLOCK_S)
            if OVERLAP:  # slots [0, r): the previous group's first half; [r, 2r): own second half
                own = (j >= ratio) & (j < 2 * ratio)
                mine = tl.load(group_rows + p * ratio + (j - ratio), mask=own, other=0).to(tl.int64)
                theirs = tl.load(prev_rows + p * ratio + j, mask=j < ratio, other=-1).to(tl.int64)
                row = tl.where(own, mine, tl.maximum(theirs, 0))
                live = own | (theirs >= 0)
                offset = tl.where(own, d, 0)
                slot = tl.where(own, j - ratio, j)
                in_range = j < 2 * ratio
            else:
                in_range = j < ratio
                row = tl.load(group_rows + p * ratio + j, mask=in_range, other=0).to(tl.int64)
                live = in_range
                offset = j * 0
                slot = j
            for start in range(0, d, BLOCK):
                c = start + tl.arange(0, BLOCK)
                ok = in_range[:, None] & (c < d)[None, :]
                at = row[:, None] * width + offset[:, None] + c[None, :]
                g = tl.load(src_gate + at, mask=ok, other=0.0)
                if HAS_APE:
                    g = g + tl.load(
                        ape_ptr + slot[:, None] * width + offset[:, None] + c[None, :], mask=ok, other=0.0
                    )
                g = tl.where(live[:, None] & ok, g, float("-inf"))
                x = tl.load(src_kv + at, mask=ok & live[:, None], other=0.0)
                e = tl.exp(g - tl.max(g, axis=0)[None, :])
                w = (e / tl.sum(e, axis=0)[None, :]).to(x.dtype)
                term = (x.to(tl.float32) * w.to(tl.float32)).to(x.dtype).to(tl.float32)
                tl.store(out_ptr + p * d + c, tl.sum(term, axis=0).to(x.dtype), mask=c < d)
        else:  # a state row: from the sources (tokens are their first rows)
            k = p - groups
            if k < n_buf:
                s = tl.load(buf_src + k).to(tl.int64)
                r = tl.load(buf_dst + k).to(tl.int64)
                _copy_row(
                    src_kv + s * width,
                    src_gate + s * width,
                    buf_kv + r * width,
                    buf_gate + r * width,
                    width,
                    BLOCK,
                )
            elif k < n_buf + n_ovl:
                s = tl.load(ovl_src + (k - n_buf)).to(tl.int64)
                r = tl.load(ovl_dst + (k - n_buf)).to(tl.int64)
                _copy_row(
                    src_kv + s * width,
                    src_gate + s * width,
                    ovl_kv + r * width,
                    ovl_gate + r * width,
                    width,
                    BLOCK,
                )
            else:
                s = tl.load(snap_src + (k - n_buf - n_ovl)).to(tl.int64)
                r = tl.load(snap_dst + (k - n_buf - n_ovl)).to(tl.int64)
                _copy_row(
                    src_kv + s * width,
                    src_gate + s * width,
                    snap_kv + r * width,
                    snap_gate + r * width,
                    width,
                    BLOCK,
                )

    return _sources, _pool_and_write


def compress_triton(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor | None,
    buf_kv: torch.Tensor,
    buf_gate: torch.Tensor,
    ovl_kv: torch.Tensor | None,
    ovl_gate: torch.Tensor | None,
    snap_kv: torch.Tensor | None,
    snap_gate: torch.Tensor | None,
    rows: list[torch.Tensor],
) -> torch.Tensor:
    """Same contract as ``deepinfer::compress_groups`` (``takes`` holds, pools contiguous):
    two launches."""
    import triton

    src_buf, src_ovl, group, prev, buf_src, buf_dst, ovl_src, ovl_dst, snap_src, snap_dst, r_src, r_dst = rows
    overlap = ovl_kv is not None
    if not overlap:  # unused pointers
        ovl_kv, ovl_gate, snap_kv, snap_gate = buf_kv, buf_gate, buf_kv, buf_gate
        src_ovl, ovl_src, ovl_dst, snap_src, snap_dst, r_src, r_dst = (src_buf.new_empty(0),) * 7
    t, width = kv.shape
    n_src = t + src_buf.numel() + src_ovl.numel()
    dtype = torch.promote_types(kv.dtype, buf_kv.dtype)
    src_kv = kv.new_empty(n_src, width, dtype=dtype)
    src_gate = kv.new_empty(n_src, width, dtype=torch.float32)
    block = min(256, triton.next_power_of_2(max(width, 1)))
    n_restore = r_dst.numel()
    sources_kernel, pool_kernel = _kernels()
    if n_src + n_restore:
        sources_kernel[(n_src + n_restore,)](
            kv,
            gate,
            buf_kv,
            buf_gate,
            ovl_kv,
            ovl_gate,
            snap_kv,
            snap_gate,
            src_buf,
            src_ovl,
            r_src,
            r_dst,
            src_kv,
            src_gate,
            kv.stride(0),
            gate.stride(0),
            t,
            src_buf.numel(),
            src_ovl.numel(),
            n_restore,
            width,
            BLOCK=block,
            BLOCK_R=max(16, triton.next_power_of_2(n_restore)),
        )
    groups, ratio = group.shape
    d = width // 2 if overlap else width
    pooled = kv.new_empty(groups, d, dtype=dtype)
    writes = buf_dst.numel() + ovl_dst.numel() + snap_dst.numel()
    if groups + writes:
        slots = 2 * ratio if overlap else ratio
        pool_kernel[(groups + writes,)](
            src_kv,
            src_gate,
            group.contiguous(),
            prev.contiguous(),
            ape if ape is not None else src_gate,
            pooled,
            buf_kv,
            buf_gate,
            ovl_kv,
            ovl_gate,
            snap_kv,
            snap_gate,
            buf_src,
            buf_dst,
            ovl_src,
            ovl_dst,
            snap_src,
            snap_dst,
            groups,
            ratio,
            d,
            width,
            buf_dst.numel(),
            ovl_dst.numel(),
            snap_dst.numel(),
            OVERLAP=overlap,
            HAS_APE=ape is not None,
            BLOCK=max(16, min(block, 8192 // triton.next_power_of_2(max(slots, 1)))),
            BLOCK_S=max(16, triton.next_power_of_2(max(slots, 1))),
            enable_fp_fusion=False,  # products and sums round apart, as the plain math's
        )
    return pooled
