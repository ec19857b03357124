"""Lightning indexer for compressed sparse attention (model_spec.md §2.5, V4 variant).

V4's indexer owns a small overlapping compressor at ``index_head_dim`` for its keys. A query
at position p scores visible entry j by ``sum_h w_h * ReLU(q_h . k_j)`` and keeps the
``index_topk`` best; picks that are not visible (j >= (p+1)//ratio) come back as -1.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.forward_batch import CompressorState
from deepinfer.models.layers.compressor import Compressor
from deepinfer.models.layers.fake_quant import fake_quant_fp4_pow2
from deepinfer.models.layers.rope import Rotary, apply_rope


class Indexer(nn.Module):
    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        eps: float,
        rotary: Rotary,
        fake_quant: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = n_heads, head_dim, topk, ratio
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self.quantize = fake_quant_fp4_pow2 if fake_quant else None
        self.compressor = Compressor(hidden, head_dim, ratio, True, eps, rotary, quantize=self.quantize)

    def forward(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: CompressorState,
    ) -> torch.Tensor:
        """Return top-k compressed-entry indices [B, S, k] (-1 = none)."""
        b, s, _ = x.shape
        keys = self.compressor(x, state)  # [B, T, head_dim]
        t = keys.shape[1]
        if t == 0:
            return torch.empty(b, s, 0, dtype=torch.long, device=x.device)
        q = self.wq_b(q_residual).view(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        if self.quantize is not None:
            q = self.quantize(q)
        scores = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu() * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, S, T]
        visible = (positions + 1) // self.ratio  # entries j < visible may be read
        future = torch.arange(t, device=x.device).view(1, 1, -1) >= visible.unsqueeze(-1)
        index_scores = index_scores.masked_fill(future, float("-inf"))
        picks = index_scores.topk(min(self.topk, t), dim=-1).indices
        return torch.where(picks >= visible.unsqueeze(-1), torch.full_like(picks, -1), picks)
