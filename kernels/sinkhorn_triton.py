"""Triton implementation of ``deepinfer::sinkhorn`` (CUDA; also runs under
``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU tests check it).

The reference makes 2 * iters + 3 launches per mHC site, each over a few hundred bytes. Here
one launch does everything: each program holds ``BLOCK_M`` whole matrices in registers
([BLOCK_M, BLOCK_N, BLOCK_N], ``n`` padded to a power of two and masked) and runs the
softmax and every normalisation on them, in the reference's order and fp32 arithmetic.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference implementation serves every device
    triton = None

# Matrix elements one program holds (BLOCK_M * BLOCK_N**2): V4's 4 x 4 gives 64 matrices.
ELEMENTS = 1024
# Largest matrix side the kernel takes (one matrix per program at 32 x 32).
MAX_N = 32


if triton is not None:

    @triton.jit
    def _sinkhorn(
        comb_ptr,
        out_ptr,
        count,
        n,
        iters,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        i = tl.arange(0, BLOCK_N)
        m3 = m[:, None, None]
        i3 = i[None, :, None]
        j3 = i[None, None, :]
        real = m3 < count
        ok = real & (i3 < n) & (j3 < n)
        # padding divides by one, so padded entries stay 0 and never reach a real sum
        pad_rows = tl.where(real & (i3 < n), 0.0, 1.0)  # [BLOCK_M, BLOCK_N, 1]
        pad_cols = tl.where(real & (j3 < n), 0.0, 1.0)  # [BLOCK_M, 1, BLOCK_N]
        offsets = m3 * n * n + i3 * n + j3
        x = tl.load(comb_ptr + offsets, mask=ok, other=float("-inf"))
        # softmax over each row (the last index); rows of padding are all -inf, made 0 below
        row_max = tl.max(x, axis=2, keep_dims=True)
        e = tl.exp(x - tl.where(row_max == float("-inf"), 0.0, row_max))
        c = e / (tl.sum(e, axis=2, keep_dims=True) + pad_rows)
        c = tl.where(ok, c + eps, 0.0)
        c = c / (tl.sum(c, axis=1, keep_dims=True) + eps + pad_cols)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=2, keep_dims=True) + eps + pad_rows)
            c = c / (tl.sum(c, axis=1, keep_dims=True) + eps + pad_cols)
        tl.store(out_ptr + offsets, c, mask=ok)


def takes(comb: torch.Tensor) -> bool:
    """fp32 matrices of side at most ``MAX_N``; others run the reference."""
    return triton is not None and comb.dtype == torch.float32 and comb.dim() >= 2 and comb.shape[-1] <= MAX_N


def sinkhorn_triton(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Same contract as ``deepinfer::sinkhorn``: fp32 [..., n, n] logits -> mixing matrices."""
    if triton is None:
        raise RuntimeError("sinkhorn_triton needs the triton package")
    n = comb.shape[-1]
    comb = comb.contiguous()
    out = torch.empty_like(comb)
    count = comb.numel() // (n * n) if n else 0
    if count == 0:
        return out
    block_n = triton.next_power_of_2(n)
    block_m = max(1, ELEMENTS // (block_n * block_n))
    _sinkhorn[(triton.cdiv(count, block_m),)](
        comb, out, count, n, iters, eps, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return out
