"""Lightning indexer for compressed sparse attention (V4 variant).

V4's indexer owns a small overlapping compressor at ``index_head_dim`` for its keys. A query
at position p scores visible entry j by ``sum_h w_h * ReLU(q_h . k_j)`` and keeps the
``index_topk`` best visible entries.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, GroupMeta, LayerPools
from deepinfer.kernels import indexer_topk
from deepinfer.models.layers.compressor import Compressor
from deepinfer.models.layers.fake_quant import fake_quant_fp4_pow2
from deepinfer.models.layers.gather import gather_rows
from deepinfer.models.layers.rope import Rotary, apply_rope
from deepinfer.models.layers.topk import stable_topk


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
        cos: torch.Tensor,
        sin: torch.Tensor,
        pools: LayerPools,
        meta: GroupMeta,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen entries: their entry-pool rows and visibility, both [T, min(topk, E)]
        (a row may pick fewer visible entries than ``topk``; the C++ kernel's are [T, topk],
        padded with invisible columns, so compiled steps do not specialise on E against
        ``topk``). Attention then reads only these
        rows, not every entry a token can see: a masked softmax over all E visible entries
        gives the same result at E / topk times the gathers and products."""
        _, index_keys = self.compressor(x, pools.indexer, meta, pools.index_keys, batch)
        t, e = meta.entry_idx.shape
        if e == 0:
            return meta.entry_idx, meta.entry_valid
        q = self.wq_b(q_residual).view(t, self.n_heads, self.head_dim)
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        if self.quantize is not None:
            q = self.quantize(q)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        if isinstance(index_keys, torch.Tensor) and indexer_topk.takes(q, index_keys, weights):
            # one C++ kernel on the CPU: reads only the entries each row may see
            return indexer_topk.indexer_topk(
                q, index_keys, meta.entry_idx, meta.entry_valid, weights, self.topk, self.head_dim**-0.5
            )
        keys = gather_rows(index_keys, meta.entry_idx)  # [T, E, head_dim]
        scores = torch.einsum("thd,ted->the", q.float(), keys.float()).relu() * self.head_dim**-0.5
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, E]
        index_scores = index_scores.masked_fill(~meta.entry_valid, float("-inf"))
        _, picks = stable_topk(index_scores, self.topk)  # ties: the older entry wins
        return meta.entry_idx.gather(1, picks), meta.entry_valid.gather(1, picks)
