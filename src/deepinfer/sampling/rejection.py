"""Speculative verification by rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
the emitted tokens are distributed exactly as sampling the target model one token at a time.

For drafted tokens ``x_1..x_K`` with draft probabilities ``q`` and target probabilities ``p``:
accept ``x_j`` while ``u_j < p_j(x_j) / q_j(x_j)``; at the first rejection emit a token from
``max(0, p_j - q_j)`` (normalised) and stop; when all K are accepted emit a bonus token from
``p_{K+1}``. Greedy decoding is the special case of one-hot ``p`` and ``q`` (prefix match).

Written branch-free over a flat batch of requests so ``torch.compile`` can trace it; the
verification pass (compile_passes/verification.py) swaps its core for
``deepinfer::rejection_sample``. The randomness comes in as tensors (``uniform``, exponential
``noise``) so callers control the generators: sampling a categorical as
``argmax(weights / noise)`` with i.i.d. Exp(1) noise needs no normalisation of ``weights``.
"""

from __future__ import annotations

import torch


def acceptance_and_recovery(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [N, K+1, V], draft_probs [N, K, V], draft_tokens [N, K] (int64),
    uniform [N, K] in [0, 1), noise [N, K+1, V] ~ Exp(1).

    Returns (accepted [N]: how many drafted tokens are kept, recovered [N, K+1]: the token
    emitted at each position if it were the first rejection, or the bonus at K)."""
    k = draft_tokens.shape[1]
    idx = draft_tokens.unsqueeze(-1)
    p_drafted = target_probs[:, :k].gather(-1, idx).squeeze(-1)
    q_drafted = draft_probs.gather(-1, idx).squeeze(-1)
    accepted = (uniform * q_drafted < p_drafted).long().cumprod(dim=1).sum(dim=1)
    residual = torch.cat([(target_probs[:, :k] - draft_probs).clamp(min=0), target_probs[:, k:]], dim=1)
    recovered = (residual / noise).argmax(dim=-1)
    return accepted, recovered


def assemble_tokens(
    draft_tokens: torch.Tensor, accepted: torch.Tensor, recovered: torch.Tensor
) -> torch.Tensor:
    """[N, K+1]: the accepted drafts, then the recovered (or bonus) token, then -1."""
    n, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device).unsqueeze(0)
    drafted = torch.cat([draft_tokens, draft_tokens.new_zeros(n, 1)], dim=1)
    last = recovered.gather(1, accepted.unsqueeze(1))
    tokens = torch.where(pos < accepted.unsqueeze(1), drafted, last)
    return torch.where(pos <= accepted.unsqueeze(1), tokens, -1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [N, K+1] padded with -1, number of emitted tokens [N] = accepted + 1)."""
    accepted, recovered = acceptance_and_recovery(target_probs, draft_probs, draft_tokens, uniform, noise)
    return assemble_tokens(draft_tokens, accepted, recovered), accepted + 1
