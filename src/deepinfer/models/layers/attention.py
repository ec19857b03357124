"""V4/V4.1 attention: shared K=V latent, sliding window + compressed entries, per-head sinks.

This is the readable reference path: dense scores with boolean masks. The fused sparse
kernel (compile passes, Triton) must agree with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config
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
    Returns [T, H, D]. Written as plain batched matmuls so the compiler's attention pass
    (compile_passes/attention.py) can find it and call ``deepinfer::sink_attention``.
    """
    scores = [
        torch.where(visible.unsqueeze(1), torch.bmm(q, kv.transpose(1, 2)) * scale, float("-inf"))
        for kv, visible in parts
    ]
    sinks = sink.to(q.dtype).view(1, -1, 1).expand(q.shape[0], q.shape[1], 1)
    probs = torch.softmax(torch.cat([*scores, sinks], dim=-1), dim=-1)
    out = None
    start = 0
    for kv, _ in parts:
        term = torch.bmm(probs[..., start : start + kv.shape[1]].to(kv.dtype), kv)
        start += kv.shape[1]
        out = term if out is None else out + term
    assert out is not None
    return out


class LatentAttention(nn.Module):
    """The part V4 and V4.1 share: low-rank queries, the shared K=V latent in a sliding
    window, attention with per-head sinks, inverse RoPE and the grouped output projection.
    Subclasses add the compressed branch."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        head_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_rank: int,
        eps: float,
        rotary: Rotary,
        fake_quant: bool,
        q_head_norm: bool,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.o_groups, self.o_rank = o_groups, o_rank
        self.eps = eps
        self.rotary = rotary
        self.fake_quant = fake_quant
        self.q_head_norm = q_head_norm  # V4 RMS-normalises each query head; V4.1 does not
        self.wq_a = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank, eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(hidden, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.wo_a = nn.Linear(n_heads * head_dim // o_groups, o_groups * o_rank, bias=False)
        self.wo_b = nn.Linear(o_groups * o_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(n_heads, dtype=torch.float32))
        # tensor parallel: sums the ranks' partial wo_b outputs (distributed/tensor_parallel.py)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @staticmethod
    def dims(cfg) -> tuple[int, int, int, int, int, int, float]:
        """The shape arguments, read from a V4 or V4.1 config (they share the field names)."""
        return (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.head_dim,
            cfg.q_lora_rank,
            cfg.o_groups,
            cfg.o_lora_rank,
            cfg.rms_norm_eps,
        )

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Queries, the query LoRA residual, RoPE tables and the window part (this step's K=V
        written first, so a token sees itself and its chunk's earlier tokens)."""
        q, q_residual, cos, sin = self.queries(x, positions)
        raw = self.latent_kv(x, cos, sin, quantized=False)
        kv = fake_quant_fp8_pow2(raw) if self.fake_quant else raw
        stored = batch.write(pools.window, batch.window_write, kv, raw=raw)
        window = gather_rows(stored, batch.window_idx).to(kv.dtype)  # [T, W, D]
        return q, q_residual, cos, sin, (window, batch.window_valid)  # positions (p - W, p]

    def queries(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, H, D], the query LoRA residual and the RoPE tables at ``positions``."""
        cos, sin = self.rotary(positions)  # [T, rd/2]
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(x.shape[0], self.n_heads, self.head_dim)
        if self.q_head_norm:
            q = unweighted_rms_norm(q, self.eps)
        return apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), q_residual, cos, sin

    def latent_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, quantized: bool = True
    ) -> torch.Tensor:
        """The shared K=V vector [T, D] of each row (a row-wise projection: drafters that keep
        their own window cache compute it for committed rows without running attention);
        ``quantized=False``: before the QAT fake-quant (what a packed pool encodes)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return fake_quant_fp8_pow2(kv) if self.fake_quant and quantized else kv

    def attend(
        self,
        q: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        out = attention_with_sink(q, parts, self.attn_sink, self.head_dim**-0.5)
        out = apply_rope(out, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        y = self.wo_b(self._grouped_output(out))
        return y if self.reduce is None else self.reduce(y)

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """Block-diagonal low-rank output: group g of heads -> o_lora_rank, then concat."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, self.o_rank, -1)
        return torch.einsum("tgd,grd->tgr", grouped, w).reshape(out.shape[0], -1)


class Attention(LatentAttention):
    """V4: every compressing layer owns its compressor; CSA layers own an indexer too."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, main_rope: Rotary, compress_rope: Rotary) -> None:
        kind = cfg.layer_kinds[layer]
        super().__init__(
            *LatentAttention.dims(cfg),
            main_rope if kind not in (CSA, HCA) else compress_rope,
            cfg.fake_quant,
            q_head_norm=True,
        )
        self.kind = kind
        self.ratio = cfg.ratio(layer)
        h, d = cfg.hidden_size, cfg.head_dim
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
        q, q_residual, cos, sin, window = self.project(x, positions, pools, batch)
        parts = [window]
        if self.compressor is not None:
            meta = batch.groups[self.ratio]
            _, entries = self.compressor(x, pools.compressor, meta, pools.entries, batch)
            if self.indexer is not None:  # CSA: the indexer's top-k entries
                rows, visible = self.indexer(x, q_residual, cos, sin, pools, meta, batch)
            else:  # HCA: every entry whose group has closed
                rows, visible = meta.entry_idx, meta.entry_valid
            parts.append((gather_rows(entries, rows).to(q.dtype), visible))
        return self.attend(q, parts, cos, sin)
