"""What model drafters share: the draft they hand to verification and how draft tokens are
sampled from their logits (the distribution ``q`` that rejection sampling divides by)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.sampling.sampler import filter_log_probs
from deepinfer.sampling_params import SamplingParams


@dataclass
class Draft:
    """A request's proposal for the step after ``anchor_pos`` (its newest token's position)."""

    anchor_pos: int
    tokens: list[int]
    q: torch.Tensor | None  # [k, V] the draft distribution each token was sampled from (None: greedy)
    confidences: list[float]  # per position: P(accepted | the drafts before it were accepted)


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter needs of one sequence to propose after its newest token."""

    slot: int
    anchor_pos: int
    anchor_token: int
    params: SamplingParams
    generator: torch.Generator | None


class ModelDrafter(Protocol):
    """A drafter that runs layers of the target checkpoint (DSpark stages, the MTP layer)."""

    num_draft_tokens: int  # the most drafts one proposal yields
    window: int  # positions of history its private cache keeps (and feature rows it needs)
    cache_bytes: int  # memory of its per-slot state (taken from the KV-cache budget)

    def claim(self, slot: int, request_id: str) -> None: ...

    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        """Take the target's features of accepted rows (and each row's next token)."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...


def sample_drafts(
    logits: torch.Tensor, requests: list[DraftRequest]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One draft token per row of ``logits`` [B, V] with each request's own filters
    (temperature, top-k/p, min-p; one batched call) and generator; greedy requests take the
    argmax. Returns the tokens [B] and each row's draft distribution (None for greedy rows)."""
    tokens = logits.argmax(dim=-1)
    qs: list[torch.Tensor | None] = [None] * len(requests)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not sampled:
        return tokens, qs
    dev = logits.device
    params = [requests[i].params for i in sampled]
    q = filter_log_probs(
        logits[torch.tensor(sampled, device=dev)].float(),
        torch.tensor([p.temperature for p in params], device=dev),
        torch.tensor([p.top_k for p in params], device=dev),
        torch.tensor([p.top_p for p in params], device=dev),
        torch.tensor([p.min_p for p in params], device=dev),
    ).exp()
    noise = torch.stack(
        [torch.empty_like(q[0]).exponential_(generator=requests[i].generator) for i in sampled]
    )
    # Gumbel-max (an exponential race): argmax(q / Exp(1)) is a sample from q
    tokens[torch.tensor(sampled, device=dev)] = (q / noise).argmax(dim=-1)
    for j, i in enumerate(sampled):
        qs[i] = q[j]
    return tokens, qs
