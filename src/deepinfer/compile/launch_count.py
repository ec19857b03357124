"""Device kernel launches of one decode step on the CUDA code path, counted on the CPU.

An eager decode step on a GPU is host-bound when it launches many small kernels: each costs a
few microseconds of host time whatever its size. ``count_decode_launches`` runs one decode
step of a model built on the value-less ``meta`` device under a ``TorchDispatchMode`` and
counts, per layer, the ops that would launch a kernel on CUDA:

- an ATen op counts one launch, unless it only makes a view or reads metadata
  (``VIEW_OPS``) or only allocates (``ALLOCATION_OPS``), or all its outputs stay on the host
  (step metadata made in Python, a 0-d scalar); a few CUDA ops launch more than one kernel
  (``sort``, ``topk``, cuBLAS split-K), so their count is a lower bound;
- a custom op (``torch.ops.deepinfer.*``) counts what its CUDA implementation launches: the
  kernel its module registers for CUDA (``register_kernel("cuda")``, which is where each
  kernel module says what CUDA runs), else the op's default implementation, run on the same
  meta tensors under the counter;
- a Triton kernel launch (``kernel[grid](...)``) counts one and is not run.

A choice made in Python by testing ``device.type == "cuda"`` cannot be seen on ``meta``: such
code counts as its other branch. The per-op choice belongs in the op's CUDA kernel, where the
counter finds it.

The step runs eagerly (the engine's ``compile=False`` step, and what a captured graph replays
without Inductor's fusion), under ``no_grad`` so that composite ops such as ``linear`` and
``reshape`` reach the counter as the kernels they become. Per-layer launches are the launches
made inside ``layers[i]`` (its submodules included); the rest (embedding, final norm, head) are
``outside``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.models import prepare
from deepinfer.models.base import CausalLM
from deepinfer.models.loading import load_model
from deepinfer.models.registry import resolve

aten = torch.ops.aten
META = torch.device("meta")

# Ops that return a view of their input or read its metadata: no kernel on any device.
VIEW_OPS = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten._reshape_alias,
        aten.as_strided,
        aten.expand,
        aten.unsqueeze,
        aten.squeeze,
        aten.transpose,
        aten.permute,
        aten.t,
        aten.slice,
        aten.select,
        aten.narrow,
        aten.split,
        aten.split_with_sizes,
        aten.unbind,
        aten.diagonal,
        aten.unfold,
        aten.detach,
        aten.alias,
        aten.lift_fresh,
        aten.view_as_real,
        aten.view_as_complex,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.is_same_size,
    }
)
# Ops that allocate without writing: the caching allocator, no kernel.
ALLOCATION_OPS = frozenset(
    {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
)


@dataclass
class LaunchCount:
    """Launches by op name, inside each layer and outside the layers."""

    per_layer: list[Counter[str]]
    outside: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.outside.values()) + sum(sum(c.values()) for c in self.per_layer)

    @property
    def layer_total(self) -> int:
        return sum(sum(c.values()) for c in self.per_layer)

    @property
    def per_layer_mean(self) -> float:
        """(total - launches outside the layers) / layers."""
        return self.layer_total / max(1, len(self.per_layer))

    def by_op(self) -> Counter[str]:
        """Every launch by op name, layers and outside together."""
        out = Counter(self.outside)
        for c in self.per_layer:
            out.update(c)
        return out


def _flat(values: Any) -> Iterator[Any]:
    if isinstance(values, list | tuple):
        for v in values:
            yield from _flat(v)
    else:
        yield values


def _on_device(out: Any) -> bool:
    """Whether any tensor of ``out`` lives on the counted device (not the host)."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in _flat(out))


def cuda_implementation(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """What the dispatcher runs for the custom op ``op`` on CUDA tensors: the kernel its
    module registered for CUDA (disabled ones fall back inside it), else its default one."""
    definition = OPDEFS.get(op._schema.name)
    if definition is None:
        raise NotImplementedError(f"{op}: not a torch.library.custom_op; its CUDA launches are unknown")
    return definition._backend_fns.get("cuda") or definition._init_fn


@contextlib.contextmanager
def kernels_disabled(names: Sequence[str]) -> Iterator[None]:
    """Count with the CUDA kernels of the custom ops ``names`` ("deepinfer::sinkhorn")
    switched off: what the step launched before they existed (their default implementation)."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(OPDEFS[name].set_kernel_enabled("cuda", False))
        yield


class LaunchCounter(TorchDispatchMode):
    """Counts launches (see the module docstring) into ``counts[scope]``; ``scope`` is the
    layer running (None outside the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[int | None, Counter[str]] = {}
        self.scope: list[int] = []

    def record(self, name: str) -> None:
        key = self.scope[-1] if self.scope else None
        self.counts.setdefault(key, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # ``reshape``, ``flatten``, ``linear``: count the ops they become
                return func.decompose(*args, **kwargs)
        if func.namespace == "deepinfer":
            with self:  # the CUDA implementation's own launches, on the same meta tensors
                cuda_implementation(func)(*args, **kwargs)
            return func(*args, **kwargs)  # the op's fake: the output the step goes on with
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in VIEW_OPS or packet in ALLOCATION_OPS:
            return out
        if func.is_view:
            raise NotImplementedError(f"{func} may return a view: add it to VIEW_OPS if it never copies")
        if _on_device(out) or any(_on_device(a) for a in args):
            self.record(str(packet).removeprefix("aten."))
        return out

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        self.scope.append(index)
        try:
            yield
        finally:
            self.scope.pop()


@contextlib.contextmanager
def _triton_launches(counter: LaunchCounter) -> Iterator[None]:
    """``kernel[grid](...)`` records one launch in ``counter`` and runs nothing (no Triton:
    nothing to patch, as nothing can launch)."""
    if importlib.util.find_spec("triton") is None:
        yield
        return
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def launch(self, grid):
        name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "kernel")
        return lambda *args, **kwargs: counter.record(f"triton:{name}")

    KernelInterface.__getitem__ = launch
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


@contextlib.contextmanager
def _layer_scopes(counter: LaunchCounter, layers: Sequence[nn.Module]) -> Iterator[None]:
    """Attribute every module call inside ``layers[i]`` to layer ``i`` (also submodules the
    step calls directly, such as a V4.1 layer's Engram)."""
    handles = []
    for i, layer in enumerate(layers):
        for module in layer.modules():

            def enter(module, args, i=i):
                counter.scope.append(i)

            def leave(module, args, out):
                counter.scope.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def count_launches(
    fn: Callable[..., Any], *args: Any, layers: Sequence[nn.Module] = (), **kwargs: Any
) -> LaunchCount:
    """Launches of ``fn(*args, **kwargs)`` on meta tensors, per module of ``layers``."""
    counter = LaunchCounter()
    with (
        torch.inference_mode(False),
        torch.no_grad(),
        _triton_launches(counter),
        _layer_scopes(counter, layers),
        counter,
    ):
        fn(*args, **kwargs)
    per_layer = [counter.counts.get(i, Counter()) for i in range(len(layers))]
    return LaunchCount(per_layer, counter.counts.get(None, Counter()))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (``layers`` or ``model.layers``)."""
    for name in ("layers", "model.layers"):
        try:
            found = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(found, nn.ModuleList):
            return found
    raise AttributeError(f"{type(model).__name__} has no decoder layer list")


def meta_model(path: str | Path) -> CausalLM:
    """The checkpoint's model on the meta device, in the engine's form (fused projections)."""
    model = load_model(path, device=META, keep_quantized=True)
    prepare.quantize(model, None)
    return model


def meta_model_from_config(raw: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> CausalLM:
    """A ``config.json`` dict's model on the meta device with no checkpoint (shapes too big to
    write): parameters in ``dtype`` but those the loader keeps in fp32, engine form."""
    cfg, cls = resolve(raw)
    with torch.device(META):
        model = cls(cfg)
    model.allocate_stacked_experts(dtype, META)
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for leaf, t in table.items():
                if t is None or not t.is_floating_point() or model.keeps_fp32(f"{prefix}.{leaf}"):
                    continue
                cast = t.to(dtype)
                table[leaf] = nn.Parameter(cast, requires_grad=False) if isinstance(t, nn.Parameter) else cast
    prepare.quantize(model, None)
    return model.eval()


def count_decode_launches(model: CausalLM, batch_size: int = 1, block_size: int = 16) -> LaunchCount:
    """Launches of one decode step of ``batch_size`` tokens (a captured graph's bucket) of a
    meta-device ``model``."""
    layout = CacheLayout.from_specs(model.cache_spec(), block_size)
    blocks, slots = 8, max(4, batch_size)
    pools = allocate_pools(layout, blocks, slots, model.compute_dtype, META)
    padding = StepPadding.for_pools(blocks, slots, num_tokens=batch_size, max_model_len=16 * block_size)
    positions, batch = build_forward_batch(layout, pools, [], META, padding)
    ids = torch.zeros(batch_size, dtype=torch.long, device=META)
    return count_launches(model.step, ids, positions, batch, layers=decoder_layers(model))
