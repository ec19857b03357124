"""The acceptance test and residual sampling of speculative verification as one op:
``deepinfer::rejection_sample`` (contract: ``deepinfer.sampling.rejection``
``acceptance_and_recovery``). The compiler's verification pass swaps the plain form for it;
a fused GPU kernel computes the residual argmax without materialising ``[N, K+1, V]``."""

from __future__ import annotations

import torch


@torch.library.custom_op("deepinfer::rejection_sample", mutates_args=())
def rejection_sample_op(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [N] int64, recovered [N, K+1] int64)."""
    k = draft_tokens.shape[1]
    idx = draft_tokens.unsqueeze(-1)
    ratio_ok = uniform * draft_probs.gather(-1, idx).squeeze(-1) < target_probs[:, :k].gather(
        -1, idx
    ).squeeze(-1)
    accepted = ratio_ok.long().cumprod(dim=1).sum(dim=1)
    recovered = torch.empty(target_probs.shape[:2], dtype=torch.long, device=target_probs.device)
    recovered[:, :k] = ((target_probs[:, :k] - draft_probs).clamp_(min=0) / noise[:, :k]).argmax(dim=-1)
    recovered[:, k] = (target_probs[:, k] / noise[:, k]).argmax(dim=-1)
    return accepted, recovered


@rejection_sample_op.register_fake
def _(target_probs, draft_probs, draft_tokens, uniform, noise):
    n = draft_tokens.shape[0]
    return (
        draft_tokens.new_empty(n),
        draft_tokens.new_empty(target_probs.shape[:2]),
    )
