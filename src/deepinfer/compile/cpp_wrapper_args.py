"""A compiled CPU step's scalar arguments without a new tensor on every call.

Inductor's C++ wrapper (``cpp_wrapper``, the CPU default here) is entered through a small
generated Python function, ``_wrap_func``'s ``g``. On every call it turns each non-tensor
argument (the step's symbolic sizes: 57 on the tiny V4) into a new 0-d tensor with
``torch.tensor``, and the C++ side reads each one back with ``item``. On the tiny V4 that
was a sizeable share of a small decode step (benchmarks/RESULTS.md).

``cache_scalar_args`` gives such a function a replacement that takes the 0-d tensors from a
cache keyed by (type, value). The C++ side only reads them, so sharing them across calls
changes nothing it computes. Everything else the generated function does is kept: handles
made from the tensors, the argument list cleared, outputs stolen back.

It replaces only functions of exactly the form torch 2.13 generates: no graph constants
appended, every output a tensor. Anything else (another torch, another wrapper) is left
alone, and the step then runs as generated."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

# the globals and attributes the plain generated function reads, and nothing else
_PLAIN_NAMES = frozenset(
    {
        "torch",
        "_C",
        "_aoti",
        "unsafe_alloc_void_ptrs_from_tensors",
        "clear",
        "alloc_tensors_by_stealing_from_void_ptrs",
    }
)
_LISTCOMP_NAMES = frozenset({"isinstance", "torch", "Tensor", "tensor"})
MAX_CACHED = 1 << 16  # distinct scalar values kept (sizes of steps); beyond, made per call
_SEARCH_LIMIT = 200_000  # objects visited looking for a compiled function's graphs
# never entered: data without compiled graphs, or the way into the whole interpreter
_NOT_ENTERED = (
    torch.Tensor,
    torch.nn.Module,
    type,
    types.ModuleType,
    types.CodeType,
    types.BuiltinFunctionType,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
)


def _attributes(obj: Any) -> list[Any]:
    """What ``obj`` holds as data: a function's closure, defaults and attributes (not its
    globals, which lead to whole modules), a method's object and function, a container's
    items, an object's attributes. Read through the type, never ``isinstance`` or
    ``getattr`` on the object, so no proxy object's hooks run."""
    kind = type(obj)
    if kind is types.FunctionType:
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return [*cells, obj.__dict__, obj.__defaults__, obj.__kwdefaults__]
    if kind is types.MethodType:
        return [obj.__self__, obj.__func__]
    if kind is functools.partial:
        return [obj.func, obj.args, obj.keywords]
    if issubclass(kind, dict):
        return list(dict.values(obj))
    if kind in (list, tuple, set, frozenset):
        return list(obj)
    found = []
    names = ["__dict__"]
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if type(slots) is str else list(slots)
    for name in names:
        try:
            found.append(object.__getattribute__(obj, name))
        except Exception:  # no such attribute, an empty slot, a C type without a dict
            pass
    return found


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _compiled_graphs(root: Any) -> list[Any]:
    """The ``CompiledFxGraph`` objects a step variant holds (loaded or just compiled), found by
    walking its data: attributes, closures, containers. Tensors, modules, types and numbers
    are not entered (a step's model and its weights hold no compiled graph)."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, stack = [], set(), [root]
    while stack and len(seen) < _SEARCH_LIMIT:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        kind = type(obj)
        if kind is CompiledFxGraph:
            found.append(obj)
            continue
        if issubclass(kind, _NOT_ENTERED):
            continue
        stack.extend(_attributes(obj))
    return found


def _entry_of_plain_wrapper(fn: Any) -> Callable[[Any], Any] | None:
    """The C++ entry point a generated ``g`` calls, when ``g`` has exactly the plain form."""
    if type(fn) is not types.FunctionType or fn.__qualname__ != "_wrap_func.<locals>.g":
        return None
    code = fn.__code__
    if set(code.co_names) != _PLAIN_NAMES or fn.__closure__ is None or len(fn.__closure__) != 1:
        return None
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    if len(inner) != 1 or set(inner[0].co_names) != _LISTCOMP_NAMES:
        return None
    entry = fn.__closure__[0].cell_contents
    return entry if callable(entry) else None


def _cached_call(entry: Callable[[Any], Any]) -> Callable[[list[Any]], Any]:
    """The generated function's work with the scalars' 0-d tensors taken from a cache."""
    cache: dict[tuple[type, Any], torch.Tensor] = {}
    to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
    from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs

    # where the scalars sit in the argument list (a graph's signature fixes it), learned on
    # the first call: later calls replace just those instead of testing all ~280 arguments
    layout: list[Any] = [None, ()]  # [argument count, scalar positions]

    def scalar_tensor(arg: Any) -> torch.Tensor:
        key = (type(arg), arg)
        scalar = cache.get(key)
        if scalar is None:
            scalar = torch.tensor(arg, device="cpu")
            if len(cache) < MAX_CACHED:
                cache[key] = scalar
        return scalar

    def call(args: list[Any]) -> Any:
        count, positions = layout
        if len(args) == count and all(not isinstance(args[i], torch.Tensor) for i in positions):
            tensors = list(args)
            for i in positions:
                tensors[i] = scalar_tensor(args[i])
        else:
            layout[:] = len(args), tuple(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors = [a if isinstance(a, torch.Tensor) else scalar_tensor(a) for a in args]
        handles = to_handles(tensors)
        args.clear()  # the inputs are released as the generated function releases them
        del tensors
        return from_handles(entry(handles))

    return call


def cache_scalar_args(variant: Any) -> int:
    """Give every plain C++-wrapper entry function of ``variant``'s compiled graphs cached
    scalar arguments; returns how many were replaced (0 where none has the plain form)."""
    replaced = 0
    for graph in _compiled_graphs(variant):
        entry = _entry_of_plain_wrapper(getattr(graph, "current_callable", None))
        if entry is not None:
            graph.current_callable = _cached_call(entry)
            replaced += 1
    return replaced
