"""The mHC sites as two launches on CUDA: ``deepinfer::hc_pre`` and ``deepinfer::hc_post``.

Around each sublayer the plain form makes some twenty small launches: the streams' norm, the
mixing projection, the sigmoids and affine maps of ``pre``/``post``/``comb``, Sinkhorn, the
collapse into the sublayer's input, and the expand back into the streams (cast, batched
matmul, multiply, add). Each reads a few kilobytes, so an eager decode step is bound by their
launch cost. ``hc_pre`` does the norm, projection, mixes, Sinkhorn and collapse in one launch
(one program per token); ``hc_post`` does the expand in another.

The plain forms here (``mixes``, ``collapse``, ``expand``) are the model's definitions, which
CPU steps, compiled steps (Inductor fuses them itself), autograd and ``batch_invariant`` run,
and which are each op's default implementation. The kernels are defined at the first CUDA
call, so CPU-only machines never import Triton; they also run under ``TRITON_INTERPRET=1`` on
CPU tensors (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from deepinfer.kernels.rms_norm_triton import reference as rms_norm_reference
from deepinfer.kernels.sinkhorn import sinkhorn
from deepinfer.kernels.triton_support import triton_installed

# Widest stream count the kernels hold in registers (``comb`` is [n, n] per token).
MAX_STREAMS = 16
# Most tokens one launch takes: each program reads the whole mixing matrix, which suits decode
# steps; a prefill's many tokens are better served by the plain form's one matrix product.
MAX_TOKENS = 512
# Inner-dimension chunk of the projection, and hidden-dimension chunk of collapse / expand.
BLOCK_K = 256
BLOCK_D = 256


def mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [..., n], post [..., n], comb [..., n, n])`` in fp32 for streams [..., n, d]."""
    n = streams.shape[-2]
    flat = rms_norm_reference(streams.flatten(-2).float(), None, norm_eps)
    m = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
    return pre, post, sinkhorn(comb, iters, hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_c pre_c * X_c`` in fp32, cast to the stream dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``out[c'] = post_c' * y + sum_c comb[c, c'] * R_c`` (sum over comb's first index)."""
    dtype = residual.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + mixed


def pre_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    collapse_with: torch.Tensor | None,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, pre, post, comb)``: the site's mixes, and the streams collapsed with
    ``collapse_with`` (V4.1's lagged mix) or, when it is None, with the site's own ``pre``."""
    pre, post, comb = mixes(streams, fn, base, scale, iters, hc_eps, norm_eps)
    x = collapse(streams, pre if collapse_with is None else collapse_with)
    return x, pre, post, comb


@torch.library.custom_op("deepinfer::hc_pre", mutates_args=())
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    collapse_with: torch.Tensor | None,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [..., n, d] -> (x [..., d], pre [..., n], post [..., n], comb [..., n, n])."""
    out = pre_reference(streams, fn, base, scale, collapse_with, iters, hc_eps, norm_eps)
    return tuple(t.contiguous() for t in out)


@hc_pre.register_fake
def _(streams, fn, base, scale, collapse_with, iters, hc_eps, norm_eps):
    lead, n = streams.shape[:-2], streams.shape[-2]
    f32 = torch.float32
    return (
        streams.new_empty((*lead, streams.shape[-1])),
        streams.new_empty((*lead, n), dtype=f32),
        streams.new_empty((*lead, n), dtype=f32),
        streams.new_empty((*lead, n, n), dtype=f32),
    )


@torch.library.custom_op("deepinfer::hc_post", mutates_args=())
def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [..., d], residual [..., n, d], post [..., n], comb [..., n, n] -> streams [..., n, d]."""
    return expand(y, residual, post, comb).contiguous()


@hc_post.register_fake
def _(y, residual, post, comb):
    return residual.new_empty(residual.shape)


def takes_pre(streams: torch.Tensor, fn: torch.Tensor, collapse_with: torch.Tensor | None) -> bool:
    """Float streams [..., n, d] of at most ``MAX_TOKENS`` tokens with n <= ``MAX_STREAMS``, an
    fp32 ``fn`` of the mixing rows, an fp32 ``collapse_with`` (and Triton installed)."""
    if not triton_installed() or streams.dim() < 2 or not streams.is_floating_point():
        return False
    n = streams.shape[-2]
    return (
        0 < n <= MAX_STREAMS
        and streams.shape[:-2].numel() <= MAX_TOKENS
        and fn.dtype == torch.float32
        and tuple(fn.shape) == ((2 + n) * n, n * streams.shape[-1])
        and (
            collapse_with is None
            or (collapse_with.dtype == torch.float32 and collapse_with.shape == streams.shape[:-1])
        )
    )


def takes_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> bool:
    """y in the residual's float dtype, fp32 mixes, n <= ``MAX_STREAMS`` (and Triton installed)."""
    return (
        triton_installed()
        and residual.dim() >= 2
        and residual.is_floating_point()
        and y.dtype == residual.dtype
        and y.shape == residual.shape[:-2] + residual.shape[-1:]
        and post.shape == residual.shape[:-1]
        and comb.shape == residual.shape[:-1] + residual.shape[-2:-1]
        and 0 < residual.shape[-2] <= MAX_STREAMS
        and post.dtype == torch.float32
        and comb.dtype == torch.float32
    )


@hc_pre.register_kernel("cuda")
def _pre_cuda(streams, fn, base, scale, collapse_with, iters, hc_eps, norm_eps):
    if takes_pre(streams, fn, collapse_with):
        return pre_triton(streams, fn, base, scale, collapse_with, iters, hc_eps, norm_eps)
    out = pre_reference(streams, fn, base, scale, collapse_with, iters, hc_eps, norm_eps)
    return tuple(t.contiguous() for t in out)


@hc_post.register_kernel("cuda")
def _post_cuda(y, residual, post, comb):
    if takes_post(y, residual, post, comb):
        return post_triton(y, residual, post, comb)
    return expand(y, residual, post, comb).contiguous()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _hc_pre(
        streams_ptr,
        fn_ptr,
        base_ptr,
        scale_ptr,
        with_ptr,
        x_ptr,
        pre_ptr,
        post_ptr,
        comb_ptr,
        n,
        d,
        iters,
        hc_eps,
        norm_eps,
        HAS_WITH: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        width = n * d
        row = streams_ptr + t * width
        i = tl.arange(0, BLOCK_N)
        ok_i = i < n
        i2, j2 = i[:, None], i[None, :]
        ok2 = (i2 < n) & (j2 < n)
        ks = tl.arange(0, BLOCK_K)
        # the projection of the raw streams; the norm is a per-token factor applied after
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        acc_pre = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_post = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_comb = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
        comb_rows = 2 * n + i2 * n + j2  # fn's rows of comb[i, j]
        for k0 in range(0, width, BLOCK_K):
            k = k0 + ks
            ok_k = k < width
            x = tl.load(row + k, mask=ok_k, other=0.0).to(tl.float32)
            squares += x * x
            rows2 = fn_ptr + i[:, None] * width + k[None, :]
            m2 = ok_i[:, None] & ok_k[None, :]
            acc_pre += tl.sum(tl.load(rows2, mask=m2, other=0.0) * x[None, :], axis=1)
            acc_post += tl.sum(tl.load(rows2 + n * width, mask=m2, other=0.0) * x[None, :], axis=1)
            rows3 = fn_ptr + comb_rows[:, :, None] * width + k[None, None, :]
            m3 = ok2[:, :, None] & ok_k[None, None, :]
            acc_comb += tl.sum(tl.load(rows3, mask=m3, other=0.0) * x[None, None, :], axis=2)
        r = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / width + norm_eps)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(acc_pre * r * s0 + tl.load(base_ptr + i, mask=ok_i, other=0.0)) + hc_eps
        post = 2.0 * tl.sigmoid(acc_post * r * s1 + tl.load(base_ptr + n + i, mask=ok_i, other=0.0))
        logits = acc_comb * r * s2 + tl.load(base_ptr + 2 * n + i2 * n + j2, mask=ok2, other=0.0)
        # Sinkhorn as ``sinkhorn_triton``: padding divides by one, so it stays 0
        pad_rows = tl.where(i2 < n, 0.0, 1.0)
        pad_cols = tl.where(j2 < n, 0.0, 1.0)
        logits = tl.where(ok2, logits, float("-inf"))
        row_max = tl.max(logits, axis=1, keep_dims=True)
        e = tl.exp(logits - tl.where(row_max == float("-inf"), 0.0, row_max))
        c = e / (tl.sum(e, axis=1, keep_dims=True) + pad_rows)
        c = tl.where(ok2, c + hc_eps, 0.0)
        c = c / (tl.sum(c, axis=0, keep_dims=True) + hc_eps + pad_cols)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps + pad_rows)
            c = c / (tl.sum(c, axis=0, keep_dims=True) + hc_eps + pad_cols)
        tl.store(pre_ptr + t * n + i, pre, mask=ok_i)
        tl.store(post_ptr + t * n + i, post, mask=ok_i)
        tl.store(comb_ptr + t * n * n + i2 * n + j2, c, mask=ok2)
        if HAS_WITH:
            w = tl.load(with_ptr + t * n + i, mask=ok_i, other=0.0)
        else:
            w = tl.where(ok_i, pre, 0.0)
        ds = tl.arange(0, BLOCK_D)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + ds
            ok_d = dd < d
            tile = tl.load(row + i[:, None] * d + dd[None, :], mask=ok_i[:, None] & ok_d[None, :], other=0.0)
            x = tl.sum(w[:, None] * tile.to(tl.float32), axis=0)
            tl.store(x_ptr + t * d + dd, x.to(x_ptr.dtype.element_ty), mask=ok_d)

    @triton.jit
    def _hc_post(
        y_ptr,
        res_ptr,
        post_ptr,
        comb_ptr,
        out_ptr,
        n,
        d,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok_d = dd < d
        c = tl.arange(0, BLOCK_N)
        ok_c = c < n
        dtype = out_ptr.dtype.element_ty
        # the plain form's roundings: comb and post cast to the stream dtype, the product and
        # the mixed streams rounded to it, then their sum
        post = tl.load(post_ptr + t * n + c, mask=ok_c, other=0.0).to(dtype).to(tl.float32)
        comb = tl.load(
            comb_ptr + t * n * n + c[:, None] * n + c[None, :], mask=ok_c[:, None] & ok_c[None, :], other=0.0
        )
        comb = comb.to(dtype).to(tl.float32)  # [c, c']
        y = tl.load(y_ptr + t * d + dd, mask=ok_d, other=0.0).to(tl.float32)
        res = tl.load(
            res_ptr + t * n * d + c[:, None] * d + dd[None, :], mask=ok_c[:, None] & ok_d[None, :], other=0.0
        )
        mixed = tl.sum(comb[:, :, None] * res.to(tl.float32)[:, None, :], axis=0)  # [c', d]
        scaled = (post[:, None] * y[None, :]).to(dtype).to(tl.float32)
        out = scaled + mixed.to(dtype).to(tl.float32)
        tl.store(
            out_ptr + t * n * d + c[:, None] * d + dd[None, :],
            out.to(dtype),
            mask=ok_c[:, None] & ok_d[None, :],
        )

    return _hc_pre, _hc_post


def pre_triton(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    collapse_with: torch.Tensor | None,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``deepinfer::hc_pre``: one program per token."""
    import triton

    lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
    rows = streams.reshape(-1, n, d).contiguous()
    count = rows.shape[0]
    x = rows.new_empty((count, d))
    pre, post = (rows.new_empty((count, n), dtype=torch.float32) for _ in range(2))
    comb = rows.new_empty((count, n, n), dtype=torch.float32)
    if count:
        with_rows = None if collapse_with is None else collapse_with.reshape(-1, n).contiguous()
        _kernels()[0][(count,)](
            rows,
            fn.contiguous(),
            base.float().contiguous(),
            scale.float().contiguous(),
            rows if with_rows is None else with_rows,
            x,
            pre,
            post,
            comb,
            n,
            d,
            iters,
            hc_eps,
            norm_eps,
            HAS_WITH=with_rows is not None,
            BLOCK_N=triton.next_power_of_2(n),
            BLOCK_K=BLOCK_K,
            BLOCK_D=BLOCK_D,
        )
    return x.view(*lead, d), pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def post_triton(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``deepinfer::hc_post``: a program per token and ``BLOCK_D`` columns."""
    import triton

    n, d = residual.shape[-2:]
    res = residual.reshape(-1, n, d).contiguous()
    count = res.shape[0]
    out = torch.empty_like(res)
    if count and d:
        _kernels()[1][(count, triton.cdiv(d, BLOCK_D))](
            y.reshape(count, d).contiguous(),
            res,
            post.reshape(count, n).contiguous(),
            comb.reshape(count, n, n).contiguous(),
            out,
            n,
            d,
            BLOCK_N=triton.next_power_of_2(n),
            BLOCK_D=BLOCK_D,
        )
    return out.view(residual.shape)
