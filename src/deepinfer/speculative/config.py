"""``SpeculativeConfig``: which drafter, how many tokens, how verification is scheduled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp", "dspark")
# drafts per step when not given: MTP-1 as V4 ran it in production (more MTP drafts lose
# throughput at high concurrency, DSpark paper §5.4); n-gram 5; DSpark: None, its block
# (``dspark_block_size`` of the checkpoint, 5 in V4.1-Flash), known once the model is
DEFAULT_DRAFTS: dict[str, int | None] = {"ngram": 5, "mtp": 1, "dspark": None}
SCHEDULES = ("static", "threshold", "hardware")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding options; vLLM's field names where it has them (``method``,
    ``num_speculative_tokens``, ``prompt_lookup_min``/``max``)."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None  # None: the method's default (DEFAULT_DRAFTS)
    # static: every eligible decode verifies up to num_speculative_tokens; hardware: Algorithm 1
    # over per-position confidences and a steps-per-second table profiled at engine start;
    # threshold: the longest prefix whose expected survival stays >= confidence_threshold.
    # Confidences: DSpark's confidence head; the other drafters' per-position acceptance rates
    schedule: str = "static"
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    confidence_threshold: float = 0.3
    # per request: stop verifying drafts that keep failing, resume when they match again
    # (speculative/adaptive.py); and in LLM.generate's closed batches, verify only the drafts
    # of requests that could be the last to finish (SpeculativeDecoder._cannot_shorten)
    adaptive: bool = True
    # DSpark on a Llama-family target: the directory of a separately trained head
    # (``deepinfer train-drafter``), or the name of one in the cache (``smollm2-135m-dspark``)
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_DRAFTS[self.method])
        if self.schedule not in SCHEDULES:
            raise ValueError(f"speculative_config.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be a bool, got {self.adaptive!r}")
        if self.model is not None:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    f"speculative_config.model must be a directory path or name, got {self.model!r}"
                )
            if self.method != "dspark":
                raise ValueError(
                    f"speculative_config.model names a DSpark head; method={self.method!r} takes none"
                )
        t = self.confidence_threshold
        if not isinstance(t, float | int) or isinstance(t, bool) or not 0 <= t <= 1:
            raise ValueError(f"speculative_config.confidence_threshold must be in [0, 1], got {t!r}")
        names = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        for name in names if self.num_speculative_tokens is not None else names[1:]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or a dict of its fields (``LLM(..., speculative_config={...})``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}")
            return cls(**value)
        raise ValueError(
            f"speculative_config must be None, a dict or a SpeculativeConfig, got {type(value).__name__}"
        )
