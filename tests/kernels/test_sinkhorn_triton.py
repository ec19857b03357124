"""The Triton Sinkhorn kernel (``kernels/sinkhorn_triton.py``), run by Triton's interpreter
on CPU tensors against ``sinkhorn.reference``: random shapes (sides that are no power of two,
counts across program blocks, empty batches), iteration counts and eps; the op's CUDA entry
point picks it; and a kernel one iteration short fails the same comparison.

Each check runs in a fresh process: the interpreter is chosen when a kernel is defined, and
other tests in this process may have imported the module without it."""

from __future__ import annotations

import pytest
from triton_interpreter import run_code_in_interpreter

pytest.importorskip("triton")  # a dev dependency; absent only on platforms without wheels

# fp32 rounding of 2 * iters normalisations of values in [0, 1] stays below this
TOLERANCE = 1e-6


_PRELUDE = f"""
import torch
from deepinfer.kernels.sinkhorn import reference
from deepinfer.kernels.sinkhorn_triton import sinkhorn_triton
TOLERANCE = {TOLERANCE}


def error(comb, iters, eps, kernel_iters=None):
    got = sinkhorn_triton(comb, iters if kernel_iters is None else kernel_iters, eps)
    assert got.shape == comb.shape and got.dtype == torch.float32 and got.is_contiguous()
    return (got - reference(comb, iters, eps)).abs().max().item() if comb.numel() else 0.0
"""


def test_matches_the_reference_on_random_cases():
    """Hypothesis: leading shapes up to 150 matrices (past one program's 64), sides 1 to 9
    and 32, 0 to 25 iterations, eps from 0 to 0.1, logits from flat to sharp."""
    run_code_in_interpreter(
        _PRELUDE
        + """
from hypothesis import given, settings, strategies as st


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lead=st.lists(st.integers(0, 150), min_size=0, max_size=2).filter(lambda s: len(s) < 2 or s[0] * s[1] <= 200),
    n=st.integers(1, 9) | st.just(32),
    iters=st.integers(0, 25),
    eps=st.sampled_from([0.0, 1e-6, 1e-3, 0.1]),
    scale=st.floats(0.01, 8.0),
    seed=st.integers(0, 10_000),
)
def check(lead, n, iters, eps, scale, seed):
    g = torch.Generator().manual_seed(seed)
    comb = torch.randn(*lead, n, n, generator=g) * scale
    assert error(comb, iters, eps) <= TOLERANCE, (lead, n, iters, eps, scale)


check()
print("ok")
"""
    )


def test_strided_input_and_the_ops_cuda_entry_point():
    """A transposed (non-contiguous) input reads as its values; the op's CUDA kernel runs
    Triton on fp32 sides up to ``MAX_N`` and the reference on anything else."""
    run_code_in_interpreter(
        _PRELUDE
        + """
from deepinfer.kernels import sinkhorn, sinkhorn_triton as module

g = torch.Generator().manual_seed(1)
comb = torch.randn(6, 4, 4, generator=g) * 3
strided = comb.transpose(-1, -2)
assert not strided.is_contiguous()
assert error(strided, 20, 1e-6) <= TOLERANCE

calls = []
real = module.sinkhorn_triton
module.sinkhorn_triton = lambda *a: calls.append(a[0].shape) or real(*a)
for shape, dtype, fused in (((5, 4, 4), torch.float32, True), ((2, 40, 40), torch.float32, False),
                            ((3, 4, 4), torch.bfloat16, False)):
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    got = sinkhorn._cuda(x, 20, 1e-6)
    assert (got.float() - reference(x, 20, 1e-6).float()).abs().max().item() <= TOLERANCE
    assert (len(calls) == 1) == fused, (shape, dtype, calls)
    calls.clear()
print("ok")
"""
    )


def test_one_iteration_fewer_fails_the_comparison():
    """Mutation check: on logits sharp enough that the iterations have not converged, the
    kernel run with one iteration fewer than the reference is far outside the tolerance (and
    with the same count, inside it)."""
    run_code_in_interpreter(
        _PRELUDE
        + """
g = torch.Generator().manual_seed(3)
for lead, n, iters in (((70,), 4, 20), ((9,), 3, 2), ((5,), 6, 7)):
    comb = torch.randn(*lead, n, n, generator=g) * 3
    assert error(comb, iters, 1e-6) <= TOLERANCE
    short = error(comb, iters, 1e-6, kernel_iters=iters - 1)
    assert short > 100 * TOLERANCE, (lead, n, iters, short)
print("ok")
"""
    )
