"""``cpp_wrapper_args``: the C++ wrapper's entry function with cached scalar arguments does what
the generated one does, and only functions of exactly the generated form are replaced.
(``test_precompiled.py`` checks that real compiled and loaded steps get it and still give
eager's tokens.)"""

from __future__ import annotations

import textwrap

import torch

from deepinfer.compile.cpp_wrapper_args import _cached_call, _entry_of_plain_wrapper

# what torch 2.13's ``CppWrapperCpu`` writes for a graph without constants whose outputs are
# all tensors, with ``extra`` spliced in where other graphs get more lines
_TEMPLATE = """
import torch

def _wrap_func(f):
    def g(args):
        input_tensors = [arg if isinstance(arg, torch.Tensor) else torch.tensor(arg, device='cpu') for arg in args]
        {extra}
        input_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(input_tensors)

        args.clear()
        del input_tensors

        output_handles = f(input_handles)
        output_tensors = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(output_handles)
        return output_tensors

    return g
"""


def _generated(entry, extra: str = "pass"):
    namespace: dict = {}
    exec(textwrap.dedent(_TEMPLATE).replace("{extra}", extra), namespace)
    return namespace["_wrap_func"](entry)


def _echo(handles):
    """A stand-in for the C++ entry: returns its inputs as its outputs (the handles are stolen
    back as tensors, as the real entry's outputs are)."""
    return handles


def test_the_generated_form_is_recognised_and_others_are_not():
    assert _entry_of_plain_wrapper(_generated(_echo)) is _echo
    constants = "input_tensors.extend([torch.ones(1)])"  # a graph with constants appends them
    assert _entry_of_plain_wrapper(_generated(_echo, constants)) is None
    assert _entry_of_plain_wrapper(lambda args: args) is None
    assert _entry_of_plain_wrapper(None) is None


def test_cached_scalars_give_what_the_generated_function_gives():
    """The same outputs (values and dtypes) over calls whose scalars repeat and change, ints
    and bools and floats that compare equal kept apart, and the argument list cleared."""
    generated, cached = _generated(_echo), _cached_call(_echo)
    x = torch.arange(6.0)
    y = torch.ones(2, dtype=torch.long)
    # the scalars' positions learned on the first call; lists laid out otherwise (a tensor
    # where a scalar was, another length) are taken apart again
    calls = [[x, 3, 7, 3], [x, True, 1, 1.0], [x, 3, 7, 3], [x, False, 0, 0.0], [x, 2048, 5, 7]]
    calls += [[x, y, 7, 3], [x, 4, y, 3], [5, x], [x, 9, 8, 7, 6], [x, 1, 2, 3]]
    for args in calls:
        args_a, args_b = list(args), list(args)
        want, got = generated(args_a), cached(args_b)
        assert args_a == [] and args_b == []
        assert len(want) == len(got)
        for w, g, arg in zip(want, got, args, strict=True):
            assert w.dtype == g.dtype and torch.equal(w, g)
            if isinstance(arg, torch.Tensor):  # a tensor argument reaches the entry itself
                assert g.data_ptr() == arg.data_ptr() == w.data_ptr()
