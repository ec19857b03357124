"""V4.1's indexer with shared keys and the two-level candidate top-k.

Only KV-source layers make index keys: ``k_norm(wk(latent))`` of their compressor's
pre-RoPE latent, rotated at the group's first position and stored beside the compressed
entries, where every later layer of the same source reads them. Every index-source layer
scores ``sum_h w_h * ReLU(q_h . k_j)`` with its own queries; the candidate source also keeps,
per query, the ``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries with the
best block maximum (the block holding the newest visible entry always kept), and the index
sources after it score only inside those blocks.

Ties (common: ReLU makes many scores exactly 0) are broken toward the older entry or block
with a stable sort, so the choice does not depend on how many columns a batch pads to; the
reference's ``topk`` leaves tie order unspecified.

The pinned candidate block is each query's own newest visible block (as the public V4.1 ports
do); DeepSeek's reference pins the block of the chunk's last entry for every query of a prefill
chunk, which differs only past ``candidate_topk_blocks`` blocks and would make results depend
on chunking.

Stale keys: the reference may score a ratio-2 layer's decode step against the last
publisher's keys; like transformers, vLLM, MLX and llama.cpp we always read the owner's keys.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, GroupMeta
from deepinfer.models.layers.fake_quant import fake_quant_fp4_pow2
from deepinfer.models.layers.gather import gather_rows
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary, apply_rope
from deepinfer.models.layers.topk import stable_topk


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, top_blocks: int, block: int
) -> torch.Tensor:
    """Level one: per query row, the entries inside its ``top_blocks`` best blocks.

    ``scores`` [T, E] has -inf where an entry is not visible; ``visible`` [T] counts each row's
    visible entries. The newest visible entry's block is pinned; blocks whose best score is -inf
    are never kept. Returns a bool mask [T, E].
    """
    e = scores.shape[1]
    padded = torch.nn.functional.pad(scores, (0, -e % block), value=float("-inf"))
    block_max = padded.unflatten(1, (-1, block)).amax(dim=-1)  # [T, NB]
    newest = torch.div(visible - 1, block, rounding_mode="floor")  # -1 when nothing is visible
    block_ids = torch.arange(block_max.shape[1], device=scores.device)
    block_max = block_max.masked_fill(block_ids.unsqueeze(0) == newest.unsqueeze(1), float("inf"))
    values, indices = stable_topk(block_max, top_blocks)
    keep = torch.zeros_like(block_max, dtype=torch.bool).scatter_(1, indices, values > float("-inf"))
    entry_block = torch.div(torch.arange(e, device=scores.device), block, rounding_mode="floor")
    return keep[:, entry_block]  # [T, E] (indexing, not a slice: E need not divide by block)


class SharedIndexer(nn.Module):
    """Queries and top-k of one index-source layer (keys come from its KV source's pool)."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        topk: int,
        eps: float,
        rotary: Rotary,
        fake_quant: bool,
        key_source_dim: int = 0,
    ) -> None:
        """``key_source_dim`` > 0: this layer is a KV source and derives the index keys from
        its compressor's ``key_source_dim``-wide latent (``wk``, ``k_norm``)."""
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.rotary = rotary
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self.fake_quant = fake_quant
        self.wk: nn.Linear | None = None
        self.k_norm: RMSNorm | None = None
        if key_source_dim:
            self.wk = nn.Linear(key_source_dim, head_dim, bias=False)
            self.k_norm = RMSNorm(head_dim, eps)

    def write_keys(
        self, latent: torch.Tensor, meta: GroupMeta, keys: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Index keys of the groups closed this step, rotated at each group's first position;
        returns the keys tensor to read."""
        assert self.wk is not None and self.k_norm is not None, "only a KV source makes index keys"
        k = self.k_norm(self.wk(latent))
        cos, sin = self.rotary(meta.group_pos)
        raw = apply_rope(k, cos, sin)
        k = fake_quant_fp4_pow2(raw) if self.fake_quant else raw
        return batch.write(keys, meta.entry_slot, k, raw=raw)

    def scores(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        meta: GroupMeta,
    ) -> torch.Tensor:
        """Index scores [T, E] over ``meta.entry_idx`` (-inf where not visible)."""
        t = x.shape[0]
        q = self.wq_b(q_residual).view(t, self.n_heads, self.head_dim)
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        if self.fake_quant:
            q = fake_quant_fp4_pow2(q)
        k = gather_rows(keys, meta.entry_idx)  # [T, E, head_dim]
        dots = torch.einsum("thd,ted->the", q.float(), k.float()).relu()
        weights = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        scores = (dots * weights.unsqueeze(-1)).sum(dim=1)
        return scores.masked_fill(~meta.entry_valid, float("-inf"))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Level two: the ``topk`` best finite scores per row, as columns of ``scores`` and
        their visibility, both [T, min(topk, E)] (attention reads only these entries)."""
        e = scores.shape[1]
        if e == 0:
            return scores.new_zeros(scores.shape, dtype=torch.long), torch.zeros_like(
                scores, dtype=torch.bool
            )
        values, indices = stable_topk(scores, self.topk)
        return indices, values > float("-inf")
