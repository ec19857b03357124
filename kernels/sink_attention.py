"""Attention over several K=V sets plus a per-head sink logit: ``deepinfer::sink_attention``.

The V4/V4.1 attention core: one softmax over the sliding window,
the compressed entries and the sink, without concatenating the key sets. The compiler's
attention pass (compile_passes/attention.py) swaps the plain model's form of it
(``attention_with_sink``) for this op. The reference implementation works part by part with
running maxima (the split-softmax a fused kernel uses), so its memory stays one part's scores.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("deepinfer::sink_attention", mutates_args=())
def sink_attention(
    q: torch.Tensor, kv: list[torch.Tensor], visible: list[torch.Tensor], sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D]; kv[i] [T, L_i, D] (K = V); visible[i] [T, L_i] bool; sink [H].
    Returns [T, H, D] = softmax over (all visible keys, sink) applied to the values."""
    m = sink.to(torch.float32).view(1, -1).expand(q.shape[0], -1)  # running max, sink included
    denom = torch.ones_like(m)  # sum of exp(logit - m); the sink contributes exp(0)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for part, vis in zip(kv, visible, strict=True):
        s = torch.bmm(q, part.transpose(1, 2)).float() * scale
        s = s.masked_fill(~vis.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        fix = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        denom = denom * fix + p.sum(dim=-1)
        acc = acc * fix.unsqueeze(-1) + torch.bmm(p.to(part.dtype), part).float()
        m = m_new
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


@sink_attention.register_fake
def _(q, kv, visible, sink, scale):
    return torch.empty_like(q)


def _register_cuda_kernel() -> None:
    """Use the Triton kernel for CUDA tensors when there is a GPU and Triton is installed
    (checked here, not on CPU-only machines, where importing Triton only costs time)."""
    if not torch.cuda.is_available():
        return
    from deepinfer.kernels.sink_attention_triton import sink_attention_triton, triton

    if triton is not None:
        sink_attention.register_kernel("cuda")(sink_attention_triton)


_register_cuda_kernel()
