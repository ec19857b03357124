"""Triton implementations of ``deepinfer::fp8_block_linear`` and of the grouped matmul of
``deepinfer::routed_experts_fp4`` (CUDA; also run under ``TRITON_INTERPRET=1`` on CPU
tensors, which is how the CPU tests check them).

The fp8 linear: one program per (rows, columns) output tile: it walks K in tiles, loads the activations and
the fp8 weight bytes (reinterpreted as e4m3), multiplies each weight by its block's scale in
registers and accumulates ``x @ w.T`` in fp32, so the weight is never dequantized in memory.
Products are exact: IEEE fp32, or TF32 where that loses nothing (bf16 activations times e4m3
codes with power-of-two scales); the result is rounded to the activations' dtype once, at the
end. The fp4 experts: rows sorted by expert, one program per (block of one expert's rows,
columns), its expert and rows read from device tensors, so one launch over a grid sized by
shapes alone serves any routing (a captured graph replays it). Registered as the ops' CUDA
kernels only when Triton is importable.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference implementation serves every device
    triton = None


if triton is not None:

    @triton.jit
    def _fp8_block_linear(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        m,
        n,
        k,
        scale_cols,
        block_n,
        block_k,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TF32: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            x = tl.load(
                x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & k_ok[None, :], other=0.0
            )
            w_ok = (cols[:, None] < n) & k_ok[None, :]
            w = tl.load(w_ptr + cols[:, None] * k + ks[None, :], mask=w_ok, other=0)
            s = tl.load(
                s_ptr + (cols[:, None] // block_n) * scale_cols + ks[None, :] // block_k, mask=w_ok, other=0.0
            )
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
            if TF32:  # exact here: bf16 activations and e4m3 x power-of-two weights fit TF32
                acc += tl.dot(x, tl.trans(w), input_precision="tf32")
            else:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        out = out_ptr + rows[:, None] * n + cols[None, :]
        tl.store(out, acc, mask=(rows[:, None] < m) & (cols[None, :] < n))


if triton is not None:

    @triton.jit
    def _fp4_grouped_linear(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        expert_ptr,
        start_ptr,
        end_ptr,
        n,
        k,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[r] = x[r] @ dequant(w[e], s[e]).T for the rows ``start .. end`` of this
        program's block, all of expert ``e`` (w [E, n, k / 2] e2m1 pairs, s [E, n, k / 32]
        e8m0); a block with no rows does nothing."""
        block = tl.program_id(0)
        first, stop = tl.load(start_ptr + block), tl.load(end_ptr + block)
        if first < stop:
            expert = tl.load(expert_ptr + block).to(tl.int64)
            w_ptr += expert * n * (k // 2)
            s_ptr += expert * n * (k // 32)
            rows = first + tl.arange(0, BLOCK_M)
            row_ok = rows < stop
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for start in range(0, k, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                k_ok = ks < k
                x = tl.load(
                    x_ptr + rows[:, None] * k + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                )
                w_ok = (cols[:, None] < n) & k_ok[None, :]
                byte = tl.load(w_ptr + cols[:, None] * (k // 2) + ks[None, :] // 2, mask=w_ok, other=0).to(
                    tl.int32
                )
                code = tl.where(ks[None, :] % 2 == 0, byte & 15, byte >> 4)
                exponent = (code >> 1) & 3
                mantissa = (code & 1).to(tl.float32)
                mag = tl.where(
                    exponent == 0,
                    mantissa * 0.5,
                    tl.exp2(exponent.to(tl.float32) - 1.0) * (1.0 + mantissa * 0.5),
                )
                value = tl.where((code >> 3) == 1, -mag, mag)
                s = tl.load(s_ptr + cols[:, None] * (k // 32) + ks[None, :] // 32, mask=w_ok, other=0.0)
                acc += tl.dot(x, tl.trans(value * s), input_precision="ieee")
            out = out_ptr + rows[:, None] * n + cols[None, :]
            tl.store(out, acc, mask=row_ok[:, None] & (cols[None, :] < n))


def expert_blocks(
    offsets: torch.Tensor, rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row block of the grouped kernel's grid: its expert, first row and end row, all on
    the device (an empty block has end == first). Rows are sorted by expert and ``offsets``
    [E] holds each expert's end row. The grid has ``ceil(rows / block_m) + min(E, rows)``
    blocks, enough for any split of the rows among the experts: its size needs shapes only,
    so a captured graph's launch fits every routing."""
    num_experts = offsets.shape[0]
    offsets = offsets.long()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)
    grid = -(-rows // block_m) + min(num_experts, rows)
    block = torch.arange(grid, device=offsets.device)
    expert = torch.searchsorted(block_ends, block, right=True).clamp(max=num_experts - 1)
    first = offsets[expert] - counts[expert] + (block - block_ends[expert] + blocks[expert]) * block_m
    end = torch.minimum(offsets[expert], first + block_m)
    return expert, first, torch.where(block < block_ends[-1], end, first)


def fp4_grouped_linear_triton(
    rows: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``rows`` [P, K] sorted by expert, ``where`` = (each row's expert [P], each expert's end
    row [E]), ``packed`` [E, N, K / 2] fp4 pairs, ``scale`` [E, N, K / 32] -> [P, N] in
    ``rows``' dtype, each row times its own expert's matrix decoded in registers. One launch
    per call and no host read (the grid comes from shapes: ``expert_blocks``)."""
    assert triton is not None
    p, k = rows.shape
    n = packed.shape[1]
    out = torch.zeros(p, n, dtype=torch.float32, device=rows.device)
    if p and n:
        block_m = 16 if p <= 256 else 64
        expert, first, end = expert_blocks(where[1], p, block_m)
        grid = (expert.shape[0], triton.cdiv(n, 64))
        _fp4_grouped_linear[grid](
            rows.float().contiguous(),
            packed.contiguous().view(torch.uint8),
            scale.float().contiguous(),
            out,
            expert,
            first,
            end,
            n,
            k,
            BLOCK_M=block_m,
            BLOCK_N=64,
            BLOCK_K=32,
        )
    return out.to(rows.dtype)


def fp8_block_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    """The op's contract (``kernels/quantized.fp8_block_linear``) in one kernel launch."""
    assert triton is not None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out.to(x.dtype)
    # bf16 activations are exact in TF32, and so are e4m3 codes times power-of-two scales
    tf32 = x.dtype == torch.bfloat16 and scale.dtype == torch.float8_e8m0fnu
    xf = x.float().contiguous()
    scales = scale.float().contiguous()
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp8_block_linear[grid](
        xf,
        weight.contiguous().view(torch.uint8),
        scales,
        out,
        m,
        n,
        k,
        scales.shape[1],
        block_n,
        block_k,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=32,
        TF32=tf32,
    )
    return out.to(x.dtype)
