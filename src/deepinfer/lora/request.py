"""Which adapter a request runs with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request (vLLM's names). ``lora_name`` identifies it to the engine
    and the server; ``lora_int_id`` is a positive integer unique per adapter; ``lora_path``
    is the PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``),
    needed the first time the name is seen."""

    lora_name: str
    lora_int_id: int
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if self.lora_path is not None and not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request.lora_path must be a string, got {type(self.lora_path).__name__}")


def per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """``generate``'s ``lora_request``: one for every prompt, or a list of ``count``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, str):
        items = list(lora_request)
        if len(items) == count and all(r is None or isinstance(r, LoRARequest) for r in items):
            return items
    raise ValueError(f"lora_request must be a LoRARequest, None, or a list of {count} of those")
