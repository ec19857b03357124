"""Serving LoRA adapters (PEFT's format) beside the base model, many in one batch.

``request.py`` names an adapter per request (vLLM's ``LoRARequest``); ``peft_format.py``
reads and checks an adapter directory against the served model; ``targets.py`` says which of
the model's linears take an adapter and how the step reaches them; ``stacks.py`` holds every
slot's A and B of one target and computes the batch's low-rank term in one grouped product;
``registry.py`` loads adapters, gives them slots and builds each step's per-row slot mask;
``step.py`` carries that mask to the layers while a step runs.
"""

from deepinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
