"""Triton implementation of ``deepinfer::fp8_block_linear`` (CUDA; also runs under
``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU tests check it).

One program per (rows, columns) output tile: it walks K in tiles, loads the activations and
the fp8 weight bytes (reinterpreted as e4m3), multiplies each weight by its block's scale in
registers and accumulates ``x @ w.T`` in fp32, so the weight is never dequantized in memory.
Products are exact: IEEE fp32, or TF32 where that loses nothing (bf16 activations times e4m3
codes with power-of-two scales); the result is rounded to the activations' dtype once, at the
end. Registered as the op's CUDA kernel only when Triton is importable.
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
    def _fp4_linear(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        m,
        n,
        k,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out [m, n] = x [m, k] @ dequant(w [n, k / 2] e2m1 pairs, s [n, k / 32] e8m0).T."""
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
            byte = tl.load(w_ptr + cols[:, None] * (k // 2) + ks[None, :] // 2, mask=w_ok, other=0).to(
                tl.int32
            )
            code = tl.where(ks[None, :] % 2 == 0, byte & 15, byte >> 4)
            exponent = (code >> 1) & 3
            mantissa = (code & 1).to(tl.float32)
            mag = tl.where(
                exponent == 0, mantissa * 0.5, tl.exp2(exponent.to(tl.float32) - 1.0) * (1.0 + mantissa * 0.5)
            )
            value = tl.where((code >> 3) == 1, -mag, mag)
            s = tl.load(s_ptr + cols[:, None] * (k // 32) + ks[None, :] // 32, mask=w_ok, other=0.0)
            acc += tl.dot(x, tl.trans(value * s), input_precision="ieee")
        out = out_ptr + rows[:, None] * n + cols[None, :]
        tl.store(out, acc, mask=(rows[:, None] < m) & (cols[None, :] < n))


def fp4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] @ dequant(``packed`` [N, K / 2] fp4 pairs, ``scale`` [N, K / 32]).T in
    ``x``'s dtype, the weight decoded in registers."""
    assert triton is not None
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _fp4_linear[grid](
            x.float().contiguous(),
            packed.contiguous().view(torch.uint8),
            scale.float().contiguous(),
            out,
            m,
            n,
            k,
            BLOCK_M=block_m,
            BLOCK_N=64,
            BLOCK_K=32,
        )
    return out.to(x.dtype)


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
