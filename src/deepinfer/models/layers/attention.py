"""V4 attention: shared K=V latent, sliding window + compressed entries, per-head sinks
(model_spec.md §2.3).

This is the readable reference path: dense scores with boolean masks. The fused sparse
kernel (compile passes, Triton) must agree with it.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config import CSA, HCA, DeepseekV4Config
from deepinfer.models.forward_batch import ForwardBatch, LayerPools
from deepinfer.models.layers.compressor import Compressor
from deepinfer.models.layers.fake_quant import fake_quant_fp4_e4m3_scale, fake_quant_fp8_pow2
from deepinfer.models.layers.gather import gather_rows
from deepinfer.models.layers.indexer import Indexer
from deepinfer.models.layers.norms import RMSNorm, unweighted_rms_norm
from deepinfer.models.layers.rope import Rotary, apply_rope


def attention_with_sink(
    q: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention over several key sets at once, plus one sink logit per head.

    q [T, H, D]; each part is (kv [T, L_i, D] with K = V, visible [T, L_i] bool). The parts
    share one softmax (as if concatenated) without materialising the concatenated keys.
    Returns [T, H, D].
    """
    scores = [
        torch.einsum("thd,tld->thl", q, kv).mul_(scale).masked_fill_(~visible.unsqueeze(1), float("-inf"))
        for kv, visible in parts
    ]
    sinks = sink.to(q.dtype).view(1, -1, 1).expand(q.shape[0], q.shape[1], 1)
    logits = torch.cat([*scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)
    out = None
    start = 0
    for kv, _ in parts:
        p = probs[..., start : start + kv.shape[1]].to(kv.dtype)
        start += kv.shape[1]
        term = torch.einsum("thl,tld->thd", p, kv)
        out = term if out is None else out + term
    assert out is not None
    return out


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, main_rope: Rotary, compress_rope: Rotary) -> None:
        super().__init__()
        self.kind = cfg.layer_kinds[layer]
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        self.rotary = main_rope if self.kind not in (CSA, HCA) else compress_rope
        h, d = cfg.hidden_size, cfg.head_dim
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(self.n_heads * d // self.o_groups, self.o_groups * self.o_rank, bias=False)
        self.wo_b = nn.Linear(self.o_groups * self.o_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.fake_quant = cfg.fake_quant
        self.ratio = cfg.ratio(layer)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind in (CSA, HCA):
            overlap = self.kind == CSA
            quantize = fake_quant_fp4_e4m3_scale if cfg.fake_quant else None
            self.compressor = Compressor(h, d, self.ratio, overlap, cfg.rms_norm_eps, compress_rope, quantize)
        if self.kind == CSA:
            self.indexer = Indexer(
                h,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                self.ratio,
                cfg.rms_norm_eps,
                compress_rope,
                cfg.fake_quant,
            )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> torch.Tensor:
        """x [T, d] at absolute ``positions`` [T] -> [T, d]; reads and writes ``pools``."""
        t = x.shape[0]
        cos, sin = self.rotary(positions)  # [T, rd/2]
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(t, self.n_heads, self.head_dim)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [T, D]
        if self.fake_quant:
            kv = fake_quant_fp8_pow2(kv)

        pools.window[batch.window_write] = kv.to(pools.window.dtype)
        window = gather_rows(pools.window, batch.window_idx).to(kv.dtype)  # [T, W, D]
        parts = [(window, batch.window_valid)]  # positions (p - window, p]
        if self.compressor is not None:
            meta = batch.groups[self.ratio]
            self.compressor(x, pools.compressor, meta, pools.entries)
            if self.indexer is not None:
                chosen = self.indexer(x, q_residual, cos, sin, pools, meta)
            else:
                chosen = meta.entry_valid  # HCA: every entry whose group has closed
            parts.append((gather_rows(pools.entries, meta.entry_idx).to(kv.dtype), chosen))

        out = attention_with_sink(q, parts, self.attn_sink, self.head_dim**-0.5)
        out = apply_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        return self.wo_b(self._grouped_output(out))

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """Block-diagonal low-rank output: group g of heads -> o_lora_rank, then concat."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, self.o_rank, -1)
        return torch.einsum("tgd,grd->tgr", grouped, w).reshape(out.shape[0], -1)
