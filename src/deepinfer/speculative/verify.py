"""Verification of drafted chunks (``[last token, d drafts]`` computed in one step, ``d + 1``
logits rows): greedy requests reduce to a prefix match against the target's argmax; sampled
ones go through the rejection sampler (``deepinfer.sampling.rejection``): accept draft j with
probability ``min(1, p_j(x_j) / q_j(x_j))``, resample from ``norm(max(p_j - q_j, 0))`` at the
first rejection, or take a bonus token from ``p_d`` after all d are accepted. Either way the
output distribution is the target's (tests/sampling/test_spec_verification.py, test_spec_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sampling.rejection import acceptance_and_recovery, assemble_tokens
from deepinfer.sampling.sampler import filter_log_probs, greedy_tokens
from deepinfer.sampling_params import SamplingParams


@dataclass
class DraftedRows:
    """One drafted chunk to verify."""

    params: SamplingParams
    generator: torch.Generator | None
    draft: list[int]  # d drafted tokens
    q: torch.Tensor | None  # [>= d, V] their draft distribution (None: deterministic, one-hot)
    logits: torch.Tensor  # [d + 1, V] the target's logits at the chunk's last d + 1 positions


def verify(items: list[DraftedRows]) -> list[list[int]]:
    """Per item the tokens to append (accepted drafts, then the recovered or bonus token).

    Greedy requests: one argmax over all their rows, then a prefix match. Sampled ones: one
    rejection-sampling call over the batch padded to the longest draft (a padded position has
    q = 0 and is cut off after, so the token after a row's last draft comes from its own p:
    the bonus); each request's randomness comes from its own generator in the order a lone
    verification would draw it."""
    out: list[list[int] | None] = [None] * len(items)
    greedy = [i for i, item in enumerate(items) if item.params.greedy]
    if greedy:
        target = greedy_tokens(torch.cat([items[i].logits for i in greedy])).tolist()
        row = 0
        for i in greedy:
            draft = items[i].draft
            mine = target[row : row + len(draft) + 1]
            row += len(draft) + 1
            accepted = next((j for j in range(len(draft)) if draft[j] != mine[j]), len(draft))
            out[i] = draft[:accepted] + [mine[accepted]]
    sampled = [i for i in range(len(items)) if out[i] is None]
    if sampled:
        for i, tokens in zip(sampled, _rejection_sample([items[i] for i in sampled]), strict=True):
            out[i] = tokens
    assert all(tokens is not None for tokens in out)
    return [tokens for tokens in out if tokens is not None]


def _rejection_sample(items: list[DraftedRows]) -> list[list[int]]:
    dev = items[0].logits.device
    k = max(len(item.draft) for item in items)
    vocab = items[0].logits.shape[-1]
    rows = torch.cat([item.logits for item in items])
    params = [item.params for item in items for _ in range(len(item.draft) + 1)]
    probs_flat = filter_log_probs(
        rows.float(),
        torch.tensor([p.temperature for p in params], device=dev),
        torch.tensor([p.top_k for p in params], device=dev),
        torch.tensor([p.top_p for p in params], device=dev),
        torch.tensor([p.min_p for p in params], device=dev),
    ).exp()
    n = len(items)
    probs = torch.full((n, k + 1, vocab), 1.0 / vocab, device=dev)
    q = torch.zeros(n, k, vocab, device=dev)
    drafted = torch.zeros(n, k, dtype=torch.long, device=dev)
    uniform = torch.zeros(n, k, device=dev)
    noise = torch.ones(n, k + 1, vocab, device=dev)
    row = 0
    for b, item in enumerate(items):
        d = len(item.draft)
        probs[b, : d + 1] = probs_flat[row : row + d + 1]
        row += d + 1
        drafted[b, :d] = torch.tensor(item.draft, dtype=torch.long, device=dev)
        if item.q is not None:
            q[b, :d] = item.q[:d].to(dev, q.dtype)
        else:  # a lookup draft is deterministic given the history: q is one-hot
            q[b, torch.arange(d, device=dev), drafted[b, :d]] = 1.0
        gen = item.generator
        uniform[b, :d] = torch.rand(d, generator=gen, device=dev)
        noise[b, : d + 1] = torch.empty(d + 1, vocab, device=dev).exponential_(generator=gen)
    accepted, recovered = acceptance_and_recovery(probs, q, drafted, uniform, noise)
    lengths = torch.tensor([len(item.draft) for item in items], device=dev)
    accepted = torch.minimum(accepted, lengths)
    tokens = assemble_tokens(drafted, accepted, recovered).tolist()
    return [t[: int(a) + 1] for t, a in zip(tokens, accepted.tolist(), strict=True)]
