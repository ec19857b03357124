"""A projection the engine may run in another form than the checkpoint's linears.

A model names its linears as transformers does (``q_proj``, ``k_proj``, ``v_proj``) so
checkpoints load by name and research code hooks what it expects. The engine's steps want
other forms of the same weights: the linears that read one input fused into one matmul,
weight-only int8/int4 copies, or copies packed for the CPU GEMM kernels. ``Projection`` holds
both: the model calls it with the step's batch; weight preparation (``prepare_projections``)
sets what an engine step runs, from outside the model, and the research binding
(``ForwardBatch.functional``) always computes from the linears' own parameters, so gradients,
hooks and ``functional_call`` reach them. The quantization method sits with the layer, as a
linear layer's quantization method does in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.kernels import lora_op
from deepinfer.kernels.huge_pages import HugePageArena
from deepinfer.kernels.weight_only import PackedLinear, WeightOnlyLinear
from deepinfer.models.layers.lora import current_step

EngineForm = Callable[[torch.Tensor], torch.Tensor]


class TiedHead:
    """The output projection of a model whose head is its embedding (``tie_word_embeddings``):
    a linear's interface over the embedding's weight, read when called (never a copy)."""

    bias = None

    def __init__(self, embedding: nn.Embedding) -> None:
        self.embedding = embedding

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Projection:
    """The concatenated outputs of ``linears`` (one linear: its output). Not a module: the
    linears stay registered where the model put them, under their checkpoint names.

    ``engine``: what an engine step runs instead (None: the linears, as research does);
    ``fused_weight``/``fused_bias``: the linears' weights as one tensor, whose slices the
    linears' parameters now are (set by ``fuse``, no extra memory)."""

    def __init__(self, *linears: Any, owner: nn.Module | None = None) -> None:
        self.linears = linears
        # ``owner``: the module the linears are registered on. The research form calls what is
        # registered there now, so a wrapper put in a linear's place (PEFT's LoRA layers) runs
        self.owner = owner
        self.names = (
            [next(n for n, m in owner.named_children() if m is li) for li in linears] if owner else []
        )
        self.engine: EngineForm | None = None
        self.fused_weight: torch.Tensor | None = None
        self.fused_bias: torch.Tensor | None = None
        self.shares = True  # the fused weight is the linears' storage (``fuse``)
        self.lora: Any = None  # served adapters' slots (``layers/lora.LinearStack``)
        # under tensor parallel, which share of the checkpoint's linears this rank holds:
        # ("out", rank, size) its rows (column parallel) or ("in", rank, size) its columns
        # (row parallel); None: whole. Served adapters are cut the same way
        self.split: tuple[str, int, int] | None = None

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        y = self.engine(x) if self.engine is not None and not batch.functional else self.plain(x)
        if self.lora is not None and batch.lora_slots is not None:  # a compiled step's form
            stack = self.lora
            return lora_op.lora_add(y, x, batch.lora_slots, stack.a, stack.b, stack.rank)
        if self.lora is not None:
            step = current_step()
            if step is not None:
                return self.lora.add_to(y, x, step)
        return y

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The checkpoint's linears, each called as a module (hooks run)."""
        linears = self.linears if self.owner is None else [getattr(self.owner, n) for n in self.names]
        if len(linears) == 1:
            return linears[0](x)
        return torch.cat([linear(x) for linear in linears], dim=-1)

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projection's weight [sum of outputs, in] and bias (detached)."""
        if self.fused_weight is not None:
            return self.fused_weight, self.fused_bias
        if len(self.linears) == 1:
            linear = self.linears[0]
            bias = linear.bias.detach() if linear.bias is not None else None
            return linear.weight.detach(), bias
        weight = torch.cat([linear.weight.detach() for linear in self.linears])
        bias = None
        if self.linears[0].bias is not None:
            bias = torch.cat([linear.bias.detach() for linear in self.linears])
        return weight, bias

    # -- the engine's forms (weight preparation) -------------------------------------------

    def fuse(self, share: bool = True) -> None:
        """One weight for several linears, with each linear's parameters re-pointed at its
        slice: one matmul instead of several, names unchanged. A single linear runs as it is.
        Called again after the linears' parameters were replaced (tensor parallel sharding).
        ``share=False`` leaves the linears' parameters alone (a trainer's optimizer holds
        them) and keeps the fused weight as a copy, which ``refresh`` renews."""
        self.fused_weight = self.fused_bias = None
        self.engine = None
        self.shares = share
        if len(self.linears) == 1:
            return
        weight, bias = self.weight_and_bias()
        if not share:
            weight, bias = weight.clone(), None if bias is None else bias.clone()
        start = 0
        for linear in self.linears if share else ():
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
        self.fused_weight, self.fused_bias = weight, bias
        self.engine = functools.partial(F.linear, weight=weight, bias=bias)

    def sources(self) -> list[torch.Tensor]:
        """The parameters the engine's forms are made from."""
        return [t for linear in self.linears for t in (linear.weight, linear.bias) if t is not None]

    def refresh(self) -> None:
        """Remake the engine's forms from the linears' current values, in place (every copy
        keeps its address)."""
        with torch.no_grad():
            if self.fused_weight is not None and not self.shares:
                self.fused_weight.copy_(torch.cat([linear.weight for linear in self.linears]))
                if self.fused_bias is not None:
                    self.fused_bias.copy_(torch.cat([linear.bias for linear in self.linears]))
            engine = self.engine
            if isinstance(engine, PackedLinear):
                engine.refresh()
            elif isinstance(engine, WeightOnlyLinear):
                engine.refresh(*self.weight_and_bias())

    def quantize(self, method: str, arena: HugePageArena | None = None) -> None:
        """Weight-only ``method`` ("int8", "int4", "bf16") copy for engine steps."""
        weight, bias = self.weight_and_bias()
        self.engine = WeightOnlyLinear(weight, bias, method, arena)

    def pack(self, arena: HugePageArena | None = None) -> None:
        """A copy packed for the CPU GEMM kernels (fp32: ours; bf16: oneDNN's), unless a
        quantized copy runs already."""
        if isinstance(self.engine, (WeightOnlyLinear, PackedLinear)):
            return  # quantized, or packed for an earlier engine
        weight, bias = self.weight_and_bias()
        self.engine = PackedLinear(weight, bias, arena)


def projections(model: nn.Module) -> Iterator[Projection]:
    """Every ``Projection`` a model's modules hold, each once."""
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Projection) and id(value) not in seen:
                seen.add(id(value))
                yield value
