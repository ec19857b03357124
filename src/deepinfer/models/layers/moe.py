"""Mixture of experts with a shared expert (model_spec.md §2.6, V4 variant with hash routing).

Routing scores are ``sqrt(softplus(logits))`` (or softmax/sigmoid); a learned bias shifts the
*selection* only; the selected scores are normalised and scaled by ``routed_scaling_factor``.
Hash layers select experts with a frozen ``tid2eid[token]`` table instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import DeepseekV4Config


class Expert(nn.Module):
    """SwiGLU with the V4 clamp: gate <= limit, |up| <= limit."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.hashed = cfg.num_experts_per_tok, hashed
        self.scoring, self.normalize = cfg.scoring_func, cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights [N, k], expert ids [N, k])."""
        logits = F.linear(x, self.weight.to(x.dtype))
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            ids = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, hashed=cfg.hash_layers[layer])
        self.experts = nn.ModuleList(Expert(h, inter, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(h, inter * cfg.n_shared_experts, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat, input_ids)
        # Sort the (token, expert) assignments by expert so each expert sees one contiguous
        # slice: one gather before the loop and one scatter after it, no per-expert search.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]
        picked = flat[token_of]
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                outs.append(self.experts[e](picked[start : start + count]))
                start += count
        routed_out = torch.cat(outs) * weights.flatten()[order].unsqueeze(1).to(flat.dtype)
        routed = torch.zeros_like(flat).index_add_(0, token_of, routed_out)
        return (routed + self.shared_experts(flat)).view(shape)
