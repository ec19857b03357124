"""A loaded step's pregraph bytecode without dynamo's per-call disable wrapper.

Dynamo's transformed ``step`` (the "pregraph bytecode" that gathers the graph's inputs)
reads every symbolic size through helpers of ``torch._dynamo.utils`` (``call_size``,
``call_stride``, ``call_storage_offset``, and the profiler's ``record_pregraph_bytecode_*``
pair). Each is wrapped in ``torch._disable_dynamo``, which switches dynamo's frame hook
off and on around the call (four ``set_eval_frame`` calls, a stance lookup, an export
check), and a tiny-V4 step makes dozens of those calls, a measurable share of a decode step
(benchmarks/RESULTS.md).

The wrapper guards against dynamo tracing the helper when the bytecode runs inside a
frame dynamo evaluates. A saved step is called directly by ``PrecompiledStep``, outside any
``torch.compile``d frame, on plain tensors whose ``size``/``stride`` are C methods that run
no Python frame; so the helpers' bodies alone (``functools.wraps`` keeps each as
``__wrapped__``) compute the same values. ``use_plain_helpers`` points the step function's
own globals (a dict dynamo made for that function alone) at a module whose helpers are the
bodies; every other name still resolves to ``torch._dynamo.utils``."""

from __future__ import annotations

import types
from typing import Any

_ALIAS = "__import_torch_dot__dynamo_dot_utils"  # how dynamo names the module in the bytecode
_HELPERS = (
    "call_size",
    "call_stride",
    "call_storage_offset",
    "record_pregraph_bytecode_enter",
    "record_pregraph_bytecode_exit",
)


class _PlainHelpers(types.ModuleType):
    """``torch._dynamo.utils`` with its disabled helpers replaced by their bodies."""

    def __init__(self, utils: types.ModuleType) -> None:
        super().__init__(utils.__name__)
        self._utils = utils
        for name in _HELPERS:
            wrapped = getattr(getattr(utils, name, None), "__wrapped__", None)
            if wrapped is not None:
                setattr(self, name, wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._utils, name)


def use_plain_helpers(compiled: Any) -> bool:
    """Point ``compiled``'s (a loaded ``AOTCompiledFunction``) pregraph bytecode at the
    helpers' bodies; False where its function does not read them the way torch 2.13's
    bytecode does (then nothing changes)."""
    fn = getattr(compiled, "fn", None)
    if type(fn) is not types.FunctionType:
        return False
    utils = fn.__globals__.get(_ALIAS)
    if not isinstance(utils, types.ModuleType) or utils.__name__ != "torch._dynamo.utils":
        return False
    plain = _PlainHelpers(utils)
    if not any(name in plain.__dict__ for name in _HELPERS):
        return False
    fn.__globals__[_ALIAS] = plain
    return True
