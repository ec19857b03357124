"""Small DSpark heads for the tiny Llama checkpoints, and the proposal workload the drafter
reference checks share: three sequences observed in two chunks each (21 and 9 rows wrap a
ring of 8), then proposed for batched and each alone."""

from __future__ import annotations

import torch

from deepinfer import SamplingParams
from deepinfer.models.dspark_head import DSparkHead, DSparkHeadConfig, save_head
from deepinfer.speculative.drafter import Draft, DraftRequest
from deepinfer.speculative.dspark import DSparkDrafter

# a head shaped like the tiny Llama's own layers (so the recipe starts it from them)
TINY_HEAD_SHAPE = {
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "window": 16,
    "markov_rank": 8,
}


def random_head(path, target_cfg: dict, seed: int, **shape) -> DSparkHead:
    """A head with every parameter random (confidence temperatures too; a random draft
    vocabulary where ``draft_vocab_size`` asks for one), saved at ``path``."""
    torch.manual_seed(seed)
    fields = {**TINY_HEAD_SHAPE, "target_layer_ids": [1, 2], "block_size": 4, "window": 8, **shape}
    cfg = DSparkHeadConfig(
        hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"], **fields
    )
    head = DSparkHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
        head.confidence_temperature.uniform_(0.5, 2.0)
        if cfg.draft_vocab_size:
            head.draft_vocab.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size])
    save_head(head, path)
    return head


def observed_proposals(
    drafter: DSparkDrafter, width: int, seed: int
) -> list[tuple[torch.Tensor, DraftRequest, Draft, Draft]]:
    """Random features of width ``width`` observed for three slots, then greedy proposals for
    all three batched and each alone: [(features, ask, batched draft, alone draft)]."""
    gen = torch.Generator().manual_seed(seed)
    lengths, anchors = {0: 21, 2: 5, 1: 9}, {0: 17, 2: 100, 1: 4}  # slot -> P, anchor token
    feats = {s: torch.randn(p, width, generator=gen) for s, p in lengths.items()}
    for s, p in lengths.items():
        drafter.claim(s, f"r{s}")
        for lo, hi in ((0, p // 2), (p // 2, p)):
            drafter.observe([s] * (hi - lo), list(range(lo, hi)), feats[s][lo:hi], [0] * (hi - lo))
    greedy = SamplingParams(temperature=0.0)
    asks = [DraftRequest(s, p, anchors[s], greedy, None) for s, p in lengths.items()]
    batched = drafter.propose(asks)
    alone = [drafter.propose([ask])[0] for ask in asks]
    return [(feats[a.slot], a, d, o) for a, d, o in zip(asks, batched, alone, strict=True)]
