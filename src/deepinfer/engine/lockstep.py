"""Lockstep generation: a batch of equal-length prompts prefilled together, then decoded one
token per step per row with the contiguous cache.

This is the single-sequence-at-a-time engine of the foundation issue (rows of the same
prompt length share a batch); the continuous-batching engine core replaces it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.models.forward_batch import ForwardBatch
from deepinfer.outputs import Logprob
from deepinfer.sampling.sampler import make_generator, sample_token
from deepinfer.sampling_params import SamplingParams


@dataclass
class RowState:
    """One request's progress: generated ids, logprobs and why it stopped."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None


def _record_logprobs(row: RowState, logits: torch.Tensor, token: int) -> None:
    if row.params.logprobs is None:
        return
    logp = logits.float().log_softmax(-1)
    entry: dict[int, Logprob] = {}
    if row.params.logprobs > 0:
        top = torch.topk(logp, row.params.logprobs)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            entry[tid] = Logprob(lp, rank)
    chosen = float(logp[token])
    rank = int((logp > logp[token]).sum()) + 1
    entry[token] = Logprob(chosen, rank)
    row.cumulative_logprob += chosen
    if row.logprobs is None:
        row.logprobs = []
    row.logprobs.append(entry)


def lockstep_generate(
    model: nn.Module,
    prompts: list[list[int]],
    params: list[SamplingParams],
    eos_token_ids: list[int],
    max_model_len: int,
) -> Iterator[list[RowState]]:
    """Yield the rows' states after every generated token until every row has finished."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("lockstep_generate needs prompts of one length")
    device = next(model.parameters()).device
    rows = [RowState(p) for p in params]
    generators = [make_generator(p, device) for p in params]
    batch = XXX
    tokens = torch.tensor(prompts, dtype=torch.long, device=device)
    length = tokens.shape[1]
    with torch.inference_mode():
        while True:
            logits = model(tokens, batch=batch)[:, -1]
            next_ids = []
            for i, row in enumerate(rows):
                if row.finish_reason is not None:
                    next_ids.append(0)  # finished rows ride along; their output is frozen
                    continue
                token = sample_token(logits[i], row.params, generators[i])
                _record_logprobs(row, logits[i], token)
                row.token_ids.append(token)
                row.finish_reason = _finish_reason(row, token, eos_token_ids, length + 1, max_model_len)
                next_ids.append(token)
            yield rows
            length += 1
            if all(r.finish_reason is not None for r in rows):
                return
            tokens = torch.tensor(next_ids, dtype=torch.long, device=device).unsqueeze(1)


def run_to_completion(steps: Iterator[list[RowState]]) -> list[RowState]:
    """Drain a :func:`lockstep_generate` iterator and return the final row states."""
    rows: list[RowState] = []
    for rows in steps:  # noqa: B007 - only the last yield matters
        pass
    return rows


def _finish_reason(
    row: RowState, token: int, eos_token_ids: list[int], length: int, max_model_len: int
) -> str | None:
    if token in row.params.stop_token_ids or (not row.params.ignore_eos and token in eos_token_ids):
        return "stop"
    if len(row.token_ids) >= row.params.max_tokens or length >= max_model_len:
        return "length"
    return None
