"""Serving LoRA adapters (PEFT's format) beside the base model, many in one batch.

``request.py`` names an adapter per request (vLLM's ``LoRARequest``); ``peft_format.py``
reads and checks an adapter directory against the served model; ``targets.py`` says which of
the model's linears take an adapter and how the step reaches them;
``registry.py`` loads adapters, gives them slots and builds each step's per-row slot mask. The
low-rank terms themselves are the layers' (``models/layers/lora.py``).
"""

from deepinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
