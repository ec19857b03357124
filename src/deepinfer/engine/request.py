"""A request's state inside the engine: tokens, cache ownership, sampling state, timing."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.outputs import Logprob
from deepinfer.sampling.sampler import SamplingRow
from deepinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # a bounded window: the window-pool block of each of block_ids' blocks, -1 once given back
    window_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks published so far
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share blocks
    lora: Any = None  # the served adapter it runs with (``lora.registry.LoadedAdapter``)
    parent_id: str | None = None  # the id of the n > 1 request this one is a sibling of
    slot: int | None = None
    dp_rank: int = 0  # data-parallel attention: the rank holding this request's cache
    restore_overlap: bool = False  # the next chunk follows a prefix-cache hit
    # a prefix hit in the host or disk tier: the load filling its blocks, the (hash, block,
    # window block) entries it fills, and whether a load of this request failed already
    tier_load: Future | None = None
    tier_items: list[tuple[bytes, int | None, int | None]] = field(default_factory=list)
    tier_failed: bool = False
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafted for this request so far ...
    num_accepted_tokens: int = 0  # ... and accepted by verification
    pending_tokens: int = 0  # tokens sampled by a step still in flight (async scheduling)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why a request finished with "error"
    text: str = ""
    text_tokens: int = 0  # how many output tokens ``text`` reflects (decoded lazily)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_full: list[torch.Tensor] | None = None  # [rows, V] log-probs, in prompt order
    cumulative_logprob: float = 0.0
    # structured outputs: the grammar matcher (xgrammar), and while it compiles its future
    grammar: Any = None
    grammar_future: Future | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    sampling_row: SamplingRow | None = None  # the sampler's view of this request, made once
    # enable_return_routed_experts: expert ids [positions, MoE layers, k] by position (-1 not
    # known yet), and which positions were computed by this request (``engine/routed_experts``)
    routed_experts: torch.Tensor | None = None
    routed_known: torch.Tensor | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without joining the prompt and output lists (a decode
        step reads one token of each running request)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - n]

    @property
    def prefix_salt(self) -> str | None:
        """What seeds its first block's hash: the cache salt and the adapter, so blocks are
        shared only between requests with equal salts and the same adapter."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00{self.lora.cache_key}"

    @property
    def num_tokens(self) -> int:
        """Tokens known or being sampled; the cache must eventually hold all but the last."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
