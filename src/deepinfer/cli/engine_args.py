"""Command-line flags turned into ``LLM``'s keyword arguments, in one place, so ``generate``,
``chat``, ``serve`` and ``bench throughput`` build their engines alike."""

from __future__ import annotations

import argparse
from typing import Any

# ``--compile``'s spellings -> ``LLM(compile=...)``
COMPILE_CHOICES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}

# engine options passed whenever the command offers their flag (argparse dest == LLM keyword)
_PASSED = (
    "dtype",
    "device",
    "quantization",
    "kv_cache_dtype",
    "speculative_config",
    "tensor_parallel_size",
    "enable_expert_parallel",
    "data_parallel_size",
    "data_parallel_replicas",
    "batch_invariant",
    "enable_return_routed_experts",
    "enable_lora",
)
# passed only when given, so the engine's own default holds otherwise
_WHEN_GIVEN = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "kv_offload_bytes",
    "kv_cache_dir",
    "kv_disk_bytes",
)


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``'s keyword arguments for the engine flags ``args`` carries; a command without a
    flag leaves that option at the engine's default."""
    kwargs = {name: getattr(args, name) for name in _PASSED if hasattr(args, name)}
    if hasattr(args, "compile"):
        kwargs["compile"] = COMPILE_CHOICES[args.compile]
    kwargs.update({name: getattr(args, name) for name in _WHEN_GIVEN if getattr(args, name, None)})
    return kwargs
