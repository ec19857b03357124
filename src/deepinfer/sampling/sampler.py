"""Temperature / top-k / top-p sampling, one request's logits at a time.

Each request owns a ``torch.Generator`` (seeded from ``SamplingParams.seed`` when given), so a
seeded request draws the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import torch

from deepinfer.sampling_params import SamplingParams


def filtered_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-distribution actually sampled from: temperature, then top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits.log_softmax(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_log_probs(logits, params).exp()
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen
