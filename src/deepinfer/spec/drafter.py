"""What model drafters share: the draft they hand to verification and how draft tokens are
sampled from their logits (the distribution ``q`` that rejection sampling divides by)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.sampling.sampler import filtered_log_probs
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
    (temperature, top-k/p, min-p) and generator; greedy requests take the argmax. Returns the
    tokens [B] and each row's draft distribution (None for greedy rows)."""
    tokens = logits.argmax(dim=-1)
    qs: list[torch.Tensor | None] = []
    for i, r in enumerate(requests):
        if r.params.greedy:
            qs.append(None)
            continue
        q = filtered_log_probs(logits[i], r.params).exp()
        noise = torch.empty_like(q).exponential_(generator=r.generator)
        tokens[i] = (q / noise).argmax()  # Gumbel-max (exponential race): a sample from q
        qs.append(q)
    return tokens, qs
