"""The pregraph helpers' bodies (``pregraph_calls``) give what dynamo's wrapped helpers give."""

from __future__ import annotations

import types

import torch
import torch._dynamo.utils as dynamo_utils

from deepinfer.compile.pregraph_calls import _ALIAS, _HELPERS, _PlainHelpers, use_plain_helpers


def test_plain_helpers_compute_what_the_wrapped_ones_do():
    plain = _PlainHelpers(dynamo_utils)
    x = torch.empty(5, 7, 3).transpose(0, 2)[1:]
    for i in range(x.dim()):
        assert plain.call_size(x, i) == dynamo_utils.call_size(x, i) == x.size(i)
        assert plain.call_stride(x, i) == dynamo_utils.call_stride(x, i) == x.stride(i)
    assert plain.call_storage_offset(x) == dynamo_utils.call_storage_offset(x) == x.storage_offset()
    cm = plain.record_pregraph_bytecode_enter()
    plain.record_pregraph_bytecode_exit(cm)
    # every helper is the body, not the disabling wrapper; other names are the module's
    assert all(getattr(plain, n) is getattr(dynamo_utils, n).__wrapped__ for n in _HELPERS)
    assert plain.is_safe_constant is dynamo_utils.is_safe_constant


def test_only_a_function_reading_dynamo_utils_is_changed():
    def step():
        return None

    holder = types.SimpleNamespace(fn=types.FunctionType(step.__code__, {_ALIAS: dynamo_utils}))
    assert use_plain_helpers(holder)
    assert isinstance(holder.fn.__globals__[_ALIAS], _PlainHelpers)
    # no such alias, another module under it, no function: left alone
    assert not use_plain_helpers(types.SimpleNamespace(fn=types.FunctionType(step.__code__, {})))
    other = types.SimpleNamespace(fn=types.FunctionType(step.__code__, {_ALIAS: types}))
    assert not use_plain_helpers(other) and other.fn.__globals__[_ALIAS] is types
    assert not use_plain_helpers(object())
