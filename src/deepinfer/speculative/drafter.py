"""The one interface every drafter implements (``Drafter``: n-gram lookup, V4's MTP layer,
V4.1's DSpark stages), the draft it hands to verification, and how model drafters sample draft
tokens from their logits (the distribution ``q`` that rejection sampling divides by)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.sampling.sampler import filter_log_probs, greedy_tokens
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
    # the request's own token lists (references, not copies): read only by history lookups
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()

    @property
    def tokens(self) -> list[int]:
        """The sequence so far (built on demand: model drafters never read it)."""
        return [*self.prompt_token_ids, *self.output_token_ids]


class Drafter(Protocol):
    """Proposes draft tokens for many sequences at once, after each step.

    A model drafter (DSpark stages, the MTP layer) keeps per-slot state built from the
    target's features of accepted rows (``observe``); a lookup drafter (n-gram) reads only the
    tokens and has ``window == 0`` (no features, no state)."""

    num_draft_tokens: int  # the most drafts one proposal yields
    window: int  # positions of history its private cache keeps (and feature rows it needs)
    cache_bytes: int  # memory of its per-slot state (taken from the KV-cache budget)
    # the target layers whose entering hidden states its features are, where the drafter
    # chooses them (a separately trained DSpark head); empty: the model's own choice
    feature_layers: tuple[int, ...]

    def claim(self, slot: int, request_id: str) -> None:
        """``request_id`` now owns ``slot`` (state left by an earlier owner is not read)."""

    def observe(
        self, slots: list[int], positions: list[int], features: torch.Tensor, next_tokens: list[int]
    ) -> None:
        """Take the target's features of accepted rows (and each row's next token)."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request (empty tokens: nothing to propose)."""


def draft_feature_offsets(num_tokens: int, num_draft: int, window: int) -> list[int]:
    """Chunk offsets whose features a drafter with a ``window`` reads: the last ``window``
    rows before the drafts, and the drafted rows (the accepted ones become history)."""
    first = max(0, num_tokens - num_draft - window)
    return list(range(first, num_tokens))


def feature_offsets_for(drafter: Drafter) -> Callable[[int, int], list[int]] | None:
    """What the model runner needs to return the features ``drafter`` reads: (chunk tokens,
    drafts) -> chunk offsets; None when it reads none."""
    if not drafter.window:
        return None
    return functools.partial(draft_feature_offsets, window=drafter.window)


def sample_drafts(
    logits: torch.Tensor, requests: list[DraftRequest]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One draft token per row of ``logits`` [B, V] with each request's own filters
    (temperature, top-k/p, min-p; one batched call) and generator; greedy requests take the
    argmax. Returns the tokens [B] and each row's draft distribution (None for greedy rows)."""
    tokens = greedy_tokens(logits)
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
