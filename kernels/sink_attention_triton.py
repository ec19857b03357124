"""Triton implementation of ``deepinfer::sink_attention`` (CUDA; also runs under
``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU tests check it).

One program per (token, head) and key set: it streams the set's K=V rows in tiles with an
online softmax and writes the partial (max, sum of exponentials, weighted sum). The partials
of all sets and the sink logit are merged in PyTorch, exactly like the reference's running
maxima. Registered as the op's CUDA kernel only when Triton is importable.
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
    def _partial_attention(
        q_ptr,
        kv_ptr,
        vis_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_heads,
        n_keys,
        dim,
        scale,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        q = tl.load(q_ptr + (t * n_heads + h) * dim + d, mask=d_ok, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for start in range(0, n_keys, BLOCK_L):
            rows = start + tl.arange(0, BLOCK_L)
            row_ok = rows < n_keys
            vis = tl.load(vis_ptr + t * n_keys + rows, mask=row_ok, other=0) != 0
            kv = tl.load(
                kv_ptr + (t * n_keys + rows)[:, None] * dim + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(kv * q[None, :], axis=1) * scale
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            fix = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe)
            denom = denom * fix + tl.sum(p, axis=0)
            acc = acc * fix + tl.sum(p[:, None] * kv, axis=0)
            m = m_new
        out = t * n_heads + h
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, denom)
        tl.store(acc_ptr + out * dim + d, acc, mask=d_ok)


def sink_attention_triton(
    q: torch.Tensor, kv: list[torch.Tensor], visible: list[torch.Tensor], sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as ``deepinfer::sink_attention``."""
    if triton is None:
        raise RuntimeError("sink_attention_triton needs the triton package")
    t, h, dim = q.shape
    q = q.contiguous()
    merged_m = sink.float().view(1, h).expand(t, h)
    partials = []
    for part, vis in zip(kv, visible, strict=True):
        m = torch.empty(t, h, dtype=torch.float32, device=q.device)
        denom = torch.empty_like(m)
        acc = torch.empty(t, h, dim, dtype=torch.float32, device=q.device)
        if t and part.shape[1]:
            _partial_attention[(t, h)](
                q,
                part.contiguous(),
                vis.to(torch.int8).contiguous(),
                m,
                denom,
                acc,
                h,
                part.shape[1],
                dim,
                scale,
                BLOCK_L=32,
                BLOCK_D=triton.next_power_of_2(dim),
            )
        else:
            m.fill_(float("-inf"))
            denom.zero_()
            acc.zero_()
        partials.append((m, denom, acc))
        merged_m = torch.maximum(merged_m, m)
    total = torch.exp(sink.float().view(1, h) - merged_m)
    out = torch.zeros(t, h, dim, dtype=torch.float32, device=q.device)
    for m, denom, acc in partials:
        w = torch.exp(m - merged_m)  # 0 for a set with no visible key (m = -inf)
        total = total + denom * w
        out = out + acc * w.unsqueeze(-1)
    return (out / total.unsqueeze(-1)).to(q.dtype)
