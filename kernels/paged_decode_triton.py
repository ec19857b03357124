"""Triton decode attention over Llama's paged K/V pools (CUDA; also runs under
``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU tests check it).

The reference decode path gathers every decode row's pool rows up to the step's padded
length (``max_model_len`` in a captured graph) and runs one masked SDPA, so a short row costs
as much memory traffic as the longest possible one. Here one program per (decode row, K/V
head) loads the row's length from the device and walks its positions in tiles of ``BLOCK``
only up to that length: the pool rows come from ``decode_kv`` (the row's block table spelled
out per position, so the tile needs no knowledge of the cache's block size), and no K, V or
index load is issued for a position past the length. The query heads sharing the K/V head
are one ``[GROUP_P, d]`` tile (GQA), scores and the running softmax stay in fp32, and the
result is written straight into the op's output rows. The grid and the loop bound's upper
limit depend only on tensor shapes, so a captured graph replays it for any lengths.
"""

from __future__ import annotations

import torch
from deepinfer.kernels import batch_invariant

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference implementation serves every device
    triton = None

# pool element types the kernel reads (int8 and fp8 rows stay on the reference path)
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _paged_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tok_ptr,
        kv_ptr,
        len_ptr,
        q_stride_t,
        q_stride_h,
        n_heads,
        group,
        dim,
        k_stride,
        v_stride,
        n_pos,
        scale_log2,
        BLOCK: tl.constexpr,
        GROUP_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HALF: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)  # decode row
        kv_head = tl.program_id(1)
        tok = tl.load(tok_ptr + i)  # its token row; -1 for a padded row
        seq_len = tl.where(tok >= 0, tl.load(len_ptr + i), 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, BLOCK_D)
        # a padded row loads no query and stores nothing (its test is broadcast to a tensor:
        # the interpreter takes a tensor-and-scalar ``&`` for no boolean mask)
        g_ok = (g < group) & (tl.zeros((GROUP_P,), tl.int64) + tok >= 0)
        d_ok = d < dim
        heads = kv_head * group + g
        tok = tl.maximum(tok, 0)
        hd_ok = g_ok[:, None] & d_ok[None, :]
        q_at = tok * q_stride_t + heads[:, None] * q_stride_h + d[None, :]
        q = tl.load(q_ptr + q_at, mask=hd_ok, other=0.0)
        if not HALF:
            q = q.to(tl.float32)
        m = tl.full((GROUP_P,), float("-inf"), tl.float32)
        denom = tl.zeros((GROUP_P,), tl.float32)
        acc = tl.zeros((GROUP_P, BLOCK_D), tl.float32)
        for b in range(0, tl.cdiv(seq_len, BLOCK)):  # tiles past the row's length never run
            pos = b * BLOCK + tl.arange(0, BLOCK)
            pos_ok = pos < seq_len
            rows = tl.load(kv_ptr + i * n_pos + pos, mask=pos_ok, other=0)
            tile_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + rows[:, None] * k_stride + kv_head * dim + d[None, :], mask=tile_ok, other=0.0
            )
            if HALF:
                s = tl.dot(q, tl.trans(k))
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            s = tl.where(pos_ok[None, :], s * scale_log2, float("-inf"))
            # a tile's first position is below the length, so m_new is finite
            m_new = tl.maximum(m, tl.max(s, axis=1))
            fix = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            denom = denom * fix + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr + rows[:, None] * v_stride + kv_head * dim + d[None, :], mask=tile_ok, other=0.0
            )
            if HALF:
                acc = acc * fix[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * fix[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m = m_new
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        out_at = (tok * n_heads + heads)[:, None] * dim + d[None, :]
        tl.store(out_ptr + out_at, o.to(out_ptr.dtype.element_ty), mask=hd_ok)


def takes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors on a device that runs Triton (the caller, the
    op's CUDA kernel, already knows the device): Triton installed, no autograd (the research
    path keeps the differentiable gather), not inside ``batch_invariant`` (whose steps compute
    the research forward's formula), plain float pools of one dtype, contiguous."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k_pool.requires_grad or v_pool.requires_grad)
    return (
        triton is not None
        and not grad
        and not batch_invariant.active()
        and q.dtype in POOL_DTYPES
        and k_pool.dtype == v_pool.dtype
        and k_pool.dtype in POOL_DTYPES
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
    )


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: torch.Tensor,
    decode_kv: torch.Tensor,
    decode_valid: torch.Tensor,
    out: torch.Tensor,
    block: int | None = None,
) -> None:
    """Decode rows of ``paged_attention_reference`` (same arguments) written into ``out``
    [T (+ 1), H, d], contiguous, at rows ``decode_rows`` (padded rows, -1, write nothing).
    A row's valid positions are a prefix of ``decode_valid``; its count is the length the
    kernel reads up to. ``block``: positions per tile (a power of two, at least 16)."""
    assert triton is not None, "paged decode attention needs the triton package"
    assert out.is_contiguous()
    n, n_pos = decode_kv.shape
    _, h, d = q.shape
    n_kv = k_pool.shape[1] // d
    if n == 0 or n_pos == 0:
        return
    group = h // n_kv
    lengths = decode_valid.sum(1, dtype=torch.int32)  # on the device: no host sync
    half = q.dtype == k_pool.dtype == v_pool.dtype and q.dtype != torch.float32
    block_d = max(16, triton.next_power_of_2(d))
    if q.stride(-1) != 1:
        q = q.contiguous()
    _paged_decode[(n, n_kv)](
        q,
        k_pool,
        v_pool,
        out,
        decode_rows.contiguous(),
        decode_kv.contiguous(),
        lengths,
        q.stride(0),
        q.stride(1),
        h,
        group,
        d,
        k_pool.stride(0),
        v_pool.stride(0),
        n_pos,
        d**-0.5 * LOG2E,
        BLOCK=block or (64 if block_d <= 128 else 32),
        GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        HALF=half,
    )
