"""Parameter counts of a (possibly meta-device) MoE model: total, backbone, and active per token.

"Active" is what one decoded token touches: every non-expert backbone weight (embedding row
and head included), the shared experts, ``k`` of ``E`` routed experts per layer, and, for
Engram, its projections plus the looked-up rows. Tables, draft stages and vision are
reported apart from the backbone, as the model card's "552B" counts them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

_ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.")


@dataclass(frozen=True)
class ParameterCount:
    total: int
    backbone: int  # embed + layers + norm + head, without Engram and draft stages
    routed_experts: int  # inside the backbone
    engram_tables: int
    engram_other: int  # Engram projections and gate weights
    draft_stages: int  # DSpark / MTP
    active_per_token: int


def count_parameters(model: nn.Module) -> ParameterCount:
    """Count from shapes only (works on the meta device)."""
    cfg = model.config
    backbone = routed = tables = engram_other = draft = 0
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.startswith("mtp."):
            draft += n
        elif ".engram.embed." in name:
            tables += n
        elif ".engram." in name:
            engram_other += n
        else:
            backbone += n
            if _ROUTED.match(name):
                routed += n
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    layers = getattr(cfg, "engram_layer_ids", []) or []
    looked_up = (
        len(layers) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        if layers
        else 0
    )
    embed_rows = cfg.vocab_size * cfg.hidden_size
    active = backbone - routed + routed * k // e - embed_rows + cfg.hidden_size + engram_other + looked_up
    return ParameterCount(total, backbone, routed, tables, engram_other, draft, active)
