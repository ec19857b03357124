"""vLLM-style request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the step's distribution (1 = best)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: token id -> Logprob (sampled token plus the top-N).
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" | "length" | "abort" | "error" (this request alone failed: ``error`` says why) |
    # None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding (0 without it)
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # SamplingParams.prompt_logprobs_full: [prompt tokens - 1, vocab] fp32 log-probabilities,
    # row i the distribution that predicts prompt token i + 1
    prompt_logprobs_full: torch.Tensor | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # the engine's weights when this output was made (``LLM.weight_version``: "0" as loaded,
    # moved on by every weight update; a request computed across an update was computed
    # again from its first token under the new weights)
    weight_version: str | None = None
    # enable_return_routed_experts: the routed experts each token ran through, [tokens, MoE
    # layers, top-k] int32 for the prompt and completion tokens the model read (all but the
    # last completion token); None otherwise
    routed_experts: torch.Tensor | None = None


@dataclass(frozen=True)
class Metric:
    """One engine series (``LLM.get_metrics()``, and ``/metrics``): a ``deepinfer:`` name, a
    counter (since the engine started) or a gauge (now), its labels and value."""

    name: str
    kind: Literal["counter", "gauge"]
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    doc: str = ""
