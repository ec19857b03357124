"""The CPU backend's one-call decode: every Llama layer of an eager step in one C++ call.

A decode step of a small model on the CPU is a few hundred small kernel calls, and the Python
between them costs as much as the math. ``LlamaDecodeStack`` (``kernels/cpu/decode_stack.py``)
runs the whole layer stack in one call over the engine's forms of the weights (packed fp32,
int8 or int4), calling the same kernels in the same order as the layer loop, so its results
equal the layer loop's bitwise. ``OneCallDecode`` is the step the model runner calls eagerly
in place of ``model.step``: the model's embedding, RoPE tables and head around the stack, for
the steps the stack covers (a few rows: decode rows, and prefill spans such as speculative
verification's drafts); every other step is the model's own.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.kernels.cpu import decode_stack
from deepinfer.kernels.cpu.decode_stack import LlamaDecodeStack, LoraTerms
from deepinfer.kernels.weight_only import PackedLinear, WeightOnlyLinear
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.lora import LoraStep
from deepinfer.models.layers.projection import Projection
from deepinfer.models.llama import LlamaForCausalLM


def _driver_weights(projection: Projection) -> tuple[Any, Any, Any, Any]:
    """(weight, bias, scale, offset) of one projection as the driver reads it."""
    engine = projection.engine
    if isinstance(engine, WeightOnlyLinear):
        if engine.bias is not None:
            raise ValueError("the stack runs quantized weights without bias")
        if engine.method == "bf16":
            raise ValueError("the stack runs fp32, int8 and int4 weights")
        if engine.method == "int8":  # the packed copy (built wherever the stack is)
            return engine.packed8, None, engine.packed_scales, None
        return engine.packed4, None, engine.scale4, engine.offset4
    weight, bias = projection.weight_and_bias()
    return weight, bias, None, None


def build_decode_stack(model: CausalLM) -> LlamaDecodeStack | None:
    """The driver over a Llama model's prepared projections: packed fp32, int8 or int4
    weights (None for other models and dtypes, under tensor parallel, or where the CPU
    kernels did not build)."""
    if not isinstance(model, LlamaForCausalLM) or model.compute_dtype != torch.float32:
        return None
    if not decode_stack.available() or any(layer.reduce is not None for layer in model.model.layers):
        return None  # tensor parallel: the one-call stack has no cross-rank sum
    cfg = model.config
    try:
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            named = {"qkv": attn.qkv, "o": attn.out, "gate_up": mlp.gate_up, "down": mlp.down}
            entry: dict[str, Any] = {name: _driver_weights(p) for name, p in named.items()}
            entry["norm1"] = layer.input_layernorm.weight.detach()
            entry["norm2"] = layer.post_attention_layernorm.weight.detach()
            entry["vnni"] = {
                name: p.engine.packed_vnni
                for name, p in named.items()
                if isinstance(p.engine, WeightOnlyLinear) and p.engine.packed_vnni is not None
            }
            entry["packed"] = {
                name: p.engine.packed for name, p in named.items() if isinstance(p.engine, PackedLinear)
            }
            layers.append(entry)
        return LlamaDecodeStack(
            layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
        )
    except ValueError:  # a layout the driver does not take
        return None


class OneCallDecode:
    """``model.step`` with the layer stack in one C++ call where ``stack`` covers the step
    (``stack = None``: always the model's own step)."""

    def __init__(self, model: LlamaForCausalLM, stack: LlamaDecodeStack) -> None:
        self.model = model
        self.stack: LlamaDecodeStack | None = stack
        # per layer, the projections the driver runs (their adapter slot stacks are read per
        # step: a stack appears with the first adapter that touches it)
        self.projections = [
            (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)
            for layer in model.model.layers
        ]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The step's logits (and its draft features when ``batch.feature_idx`` asks, taken
        between runs of the stack over the layers in between)."""
        model, stack, meta = self.model, self.stack, batch.expanded().full
        if stack is None or meta is None or batch.grid is not None or batch.hidden_states is not None:
            return model.step(input_ids, positions, batch)
        h = model.embed(input_ids)
        pools = [(p.window, p.values) for p in batch.pools]
        # padded steps carry spans of 0 tokens, which need no span kernel
        spans = bool(meta.span_meta[:, 1].any()) if meta.span_meta.shape[0] else False
        if not stack.supports(h, pools, spans=spans):
            return model.step_embedded(h, positions, batch)  # the embedding is not computed twice
        cos, sin = model.rope_tables(positions)
        lora = self.lora_terms(batch.lora, h)
        wanted = batch.feature_layers if batch.feature_idx is not None else ()
        bounds = [0, *wanted, len(model.model.layers)]
        features = []
        for first, end in zip(bounds, bounds[1:], strict=False):
            if first in wanted:  # a DSpark head reads the hidden states entering this layer
                features.append(h[batch.feature_idx])
            h = stack(
                h,
                cos,
                sin,
                batch.window_write,
                meta.decode_rows,
                meta.decode_kv,
                meta.decode_valid,
                pools,
                meta.span_meta,
                meta.span_kv_rows,
                (first, end),
                lora,
            )
        logits = model.logits(h, batch)
        if batch.feature_idx is not None:
            return logits, torch.cat(features, dim=-1) if features else logits.new_zeros(0)
        return logits

    def lora_terms(self, step: LoraStep | None, h: torch.Tensor) -> LoraTerms | None:
        """The step's served-adapter terms for the stack (None: no adapter row), with the
        projections' slot stacks as they are now (a stack appears with its first adapter)."""
        if step is None:
            return None
        step.check(h)
        stacks = [[p.lora for p in layer] for layer in self.projections]
        terms = LoraTerms(stacks, step.active, step.order, step.group_slots, step.group_starts)
        return terms if terms.any else None


def one_call_decode(model: CausalLM) -> OneCallDecode | None:
    """The eager step with the one-call stack, for a model the stack covers (else None)."""
    stack = build_decode_stack(model)
    if stack is None:
        return None
    assert isinstance(model, LlamaForCausalLM)
    return OneCallDecode(model, stack)
