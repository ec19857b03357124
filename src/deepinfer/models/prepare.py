"""The engine's forms of a loaded model's weights, made in one place, from outside the models.

A checkpoint loads as the architecture defines it, and research code computes with exactly
that. The engine prepares, in this order:
1. ``quantize``: resident fp8 blocks (``quantization="fp8"``, models whose release format
   stores fp8), or the projections' linears fused into one weight each, then weight-only
   int8/int4 forms of every projection (``Projection``). Before tensor-parallel sharding,
   which fuses a shard's projections again.
2. ``pack_for_cpu``: copies of the float projections packed for the CPU GEMM kernels, in
   huge-page memory where an arena is given.
The model's parameters stay the float ones (q/k/v and gate/up become views of their fused
weight, no extra memory).
"""

from __future__ import annotations

from deepinfer.kernels.huge_pages import HugePageArena
from deepinfer.kernels.weight_only import PackedLinear
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.projection import projections

# scale blocks of ``quantization="fp8"`` (the released V4 checkpoints' weight_block_size)
FP8_BLOCK = (128, 128)
WEIGHT_ONLY = ("int8", "int4", "bf16")


def quantize(
    model: CausalLM, quantization: str | None, arena: HugePageArena | None = None, share: bool = True
) -> None:
    """Fuse the model's projections, then apply ``quantization`` (``EngineConfig``'s: "fp8",
    "int8", "int4", "bf16"; None and "none" change nothing more, the loader having chosen the
    stored formats); refuses a method the model does not take. ``share=False`` keeps the
    parameters as they are (a trainer's): fused weights are copies, and "fp8", which replaces
    linears, is refused."""
    if quantization == "fp8":
        if not share:
            raise ValueError("quantization='fp8' replaces the model's linears; a trainer's model keeps them")
        model.quantize_fp8(FP8_BLOCK)
    for projection in projections(model):
        projection.fuse(share)
    if quantization in WEIGHT_ONLY:
        found = list(projections(model))
        if not found:
            raise ValueError(f"quantization={quantization!r} is not supported for {type(model).__name__}")
        head = getattr(model, "head", None)
        for projection in found:
            # the output head keeps 8 bits under int4, as llama.cpp keeps its output tensor
            # above 4 (Q6_K): every logit reads it, and 4-bit head weights cost SmolLM2 about
            # ten times the perplexity the 4-bit projections do (benchmarks/RESULTS.md)
            method = "int8" if quantization == "int4" and projection is head else quantization
            projection.quantize(method, arena)


def pack_for_cpu(model: CausalLM, arena: HugePageArena | None = None) -> None:
    """Packed copies of the float projections for the engine's CPU steps (fp32: our GEMM
    kernel's layout; bf16: oneDNN's, where this CPU runs it); quantized ones stay as they are."""
    found = list(projections(model))
    if found and PackedLinear.available(found[0].weight_and_bias()[0]):
        for projection in found:
            projection.pack(arena)
