"""The acceptance test and residual sampling of speculative verification as one op:
``deepinfer::rejection_sample`` (contract: ``deepinfer.sampling.rejection``
``acceptance_and_recovery``). The compiler's verification pass swaps the plain form for it,
so a fused GPU kernel (residual argmax without materialising ``[N, K+1, V]``) has one place to
plug in; none is written yet."""

from __future__ import annotations

import torch

from deepinfer.sampling.rejection import acceptance_and_recovery


@torch.library.custom_op("deepinfer::rejection_sample", mutates_args=())
def rejection_sample_op(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [N] int64, recovered [N, K+1] int64). The reference implementation
    is the plain form itself (a GPU kernel would avoid materialising the residuals)."""
    return acceptance_and_recovery(target_probs, draft_probs, draft_tokens, uniform, noise)


@rejection_sample_op.register_fake
def _(target_probs, draft_probs, draft_tokens, uniform, noise):
    n = draft_tokens.shape[0]
    return (
        draft_tokens.new_empty(n),
        draft_tokens.new_empty(target_probs.shape[:2]),
    )
