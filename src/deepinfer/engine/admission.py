"""What a new request must be before the engine takes it: every field checked once, a bad one
named in a ``ValueError``, and nothing in the engine touched until all of them pass."""

from __future__ import annotations

import math

from deepinfer.sampling_params import SamplingParams


def check_request(
    request_id: object,
    prompt_token_ids: object,
    params: object,
    cache_salt: object,
    *,
    in_use: bool,
    vocab_size: int,
    max_logprobs: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Raise ``ValueError`` naming the first bad field; ``in_use``: the id is taken already.
    The request must fit the cache whole (prompt and ``max_tokens``, capped at
    ``max_model_len``), or it could never finish."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError("the engine runs n=1 requests; LLM.generate expands n > 1 into siblings")
    params.check_vocab(vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(f"{name}: {value} is above max_logprobs={max_logprobs}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    if not isinstance(prompt_token_ids, list | tuple) or not prompt_token_ids:
        raise ValueError("prompt_token_ids must be a non-empty list of integers")
    for t in prompt_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids: token id {t!r} is not an integer in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt_token_ids: prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_model_len}"
        )
    longest = min(len(prompt_token_ids) + params.max_tokens, max_model_len)
    if math.ceil(longest / block_size) > num_blocks:
        raise ValueError(
            f"max_tokens: this request may reach {longest} tokens but the cache holds "
            f"{num_blocks * block_size}; lower max_tokens or grow the cache"
        )
