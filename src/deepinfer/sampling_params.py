"""SamplingParams: per-request decoding settings, validated once when a request arrives."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from deepinfer.structured_outputs import StructuredOutputsParams


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# Temperatures in (0, MIN_TEMPERATURE) are raised to it, as vLLM does: dividing logits by a
# smaller one overflows fp32 to inf, and the row's distribution becomes NaN
MIN_TEMPERATURE = 0.01
# OpenAI's range for a logit bias; larger values are clamped to it, as vLLM does (a bias of
# 1e39 is inf in fp32)
MAX_LOGIT_BIAS = 100.0
# entries a logit_bias may have: at least every token of the largest vocabulary served
# (Gemma's 262,144), so a request may bias them all, while the work done per request before
# the vocabulary is known (validating, converting, building its tensors) stays bounded.
# Applied per step as one tensor addition, the bias then costs at most one pass over a row
# of logits.
MAX_LOGIT_BIAS_ENTRIES = 300_000
# repetition_penalty divides or multiplies logits: this range keeps every product finite
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# seeds are int64 (OpenAI's type); torch.Generator takes them
SEED_RANGE = (-(2**63), 2**63 - 1)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(init=False)
class SamplingParams:
    """vLLM-compatible sampling settings.

    ``temperature=0`` is greedy; ``top_k`` of 0 or -1 and ``min_p=0`` disable those filters.
    Logits are processed in this order: ``logit_bias``, ``min_tokens`` (EOS and stop ids
    blocked), repetition / presence / frequency penalties, temperature, top-k, top-p, min-p.
    Reported logprobs are those of the raw model distribution. Any invalid or unknown field
    raises ``ValueError`` naming it. No accepted value can make a row's distribution NaN:
    temperatures below ``MIN_TEMPERATURE`` (but above 0) are raised to it and ``logit_bias``
    values clamped to +-``MAX_LOGIT_BIAS`` (vLLM's rules), ``repetition_penalty`` is bounded.
    ``logit_bias`` takes at most ``MAX_LOGIT_BIAS_ENTRIES`` (300,000) entries, more than any
    served vocabulary; the sampler adds it as one tensor per request, so its cost per step
    does not depend on its size beyond one vector addition.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # with prompt_logprobs: also every prompt position's log-probabilities over the whole
    # vocabulary, as one tensor (RequestOutput.prompt_logprobs_full), for perplexity and KL
    # tools; offline only
    prompt_logprobs_full: bool = False
    skip_special_tokens: bool = True
    # decoding constrained to a JSON schema, regex, choice list or grammar (a
    # StructuredOutputsParams or a dict of its fields; sampling/structured.py)
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name: f for f in fields(self)}
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        for name, f in names.items():
            if name in kwargs:
                value = kwargs[name]
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, name, value)
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "an integer in [0, max_tokens]",
            self.min_tokens,
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            _is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1)),
            "top_k",
            "-1, 0 (disabled) or an integer >= 1",
            self.top_k,
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        low, high = REPETITION_PENALTY_RANGE
        _check(
            _is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
            "repetition_penalty",
            f"a number in [{low}, {high}]",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        if self.logit_bias is None:
            self.logit_bias = {}
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
            )
        _check(
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 and _is_number(v) for k, v in self.logit_bias.items()),
            "logit_bias",
            "a dict of token id -> finite number",
            self.logit_bias,
        )
        self.logit_bias = {
            k: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(v))) for k, v in self.logit_bias.items()
        }
        low, high = SEED_RANGE
        _check(
            self.seed is None or (_is_int(self.seed) and low <= self.seed <= high),
            "seed",
            "None or an integer in [-2**63, 2**63 - 1]",
            self.seed,
        )
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.stop, list | tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a string or a list of non-empty strings",
            self.stop,
        )
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _check(
            isinstance(self.stop_token_ids, list | tuple)
            and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
            self.stop_token_ids,
        )
        self.stop_token_ids = list(self.stop_token_ids)
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "prompt_logprobs_full",
        ):
            _check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name, "None or an integer >= 0", value)
        _check(
            not self.prompt_logprobs_full or self.prompt_logprobs is not None,
            "prompt_logprobs_full",
            "False unless prompt_logprobs is set",
            self.prompt_logprobs_full,
        )
        self.structured_outputs = StructuredOutputsParams.parse(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token id {bad[0]} outside the vocabulary [0, {vocab_size})")
