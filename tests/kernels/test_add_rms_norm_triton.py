"""``deepinfer::add_rms_norm`` (``kernels/rms_norm_triton.py``) and ``deepinfer::silu_and_mul``
(``kernels/silu_mul_triton.py``), the decoder layer's residual add + norm and SwiGLU
activation as one launch each: their references are the layers' plain forms, bit for bit; the
Triton kernels, run by Triton's interpreter on CPU tensors, match them on random shapes and
dtypes; kernels that store the wrong sum, drop the weight, take the sigmoid for SiLU or read
the gate for the up half fail the same checks; and the layers call the ops only on eager non-CPU steps.

Triton decides between compiling and interpreting when it decorates a kernel, so the
interpreted checks run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_kernels_under_the_interpreter``); in this process they are skipped."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from deepinfer.kernels import rms_norm_triton, silu_mul_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, mutant_of, run_in_interpreter

from deepinfer.models.layers import dispatch, norms

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative to |value| + 1; the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so
# a bf16 result may sit two bf16 steps from the reference's
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2e-3}
# (file, source line, its mutant): each mutant must fail its kernel's check
MUTANTS = {
    "sum_not_stored": (
        "rms_norm_triton.py",
        "tl.store(sum_ptr + row * dim + cols, x, mask=ok)",
        "tl.store(sum_ptr + row * dim + cols, r, mask=ok)",
    ),
    "weight_dropped": ("rms_norm_triton.py", "y = w * (xf * r)", "y = xf * r"),
    "sigmoid_not_silu": (
        "silu_mul_triton.py",
        "act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)",
        "act = (1.0 / (1.0 + tl.exp(-g))).to(gate.dtype)",
    ),
    "up_half_misread": ("silu_mul_triton.py", "row * x_stride + width + cols", "row * x_stride + cols"),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernels_under_the_interpreter():
    run_in_interpreter(__file__)


def test_references_are_the_layers_plain_forms():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 48, generator=g).bfloat16() for _ in range(2))
    norm = norms.RMSNorm(48, 1e-6)
    norm.weight.data = torch.rand(48, generator=g) + 0.5
    total, normed = torch.ops.deepinfer.add_rms_norm(x, r, norm.weight, 1e-6)
    assert torch.equal(total, x + r) and torch.equal(normed, norm(x + r))
    assert all(map(torch.equal, norms.residual_rms_norm(norm, x, r), (total, normed)))
    gate_up = torch.randn(3, 2, 40, generator=g).half()
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(torch.ops.deepinfer.silu_and_mul(gate_up), F.silu(gate) * up)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    if not got.numel():
        return 0.0
    return ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item()


def add_norm_error(module: ModuleType, x, r, w, eps) -> float:
    got = module.add_rms_norm_triton(x, r, w, eps)
    want = rms_norm_triton.add_reference(x, r, w, eps)
    return max(error(a, b) for a, b in zip(got, want, strict=True))


def silu_error(module: ModuleType, gate_up) -> float:
    return error(module.silu_and_mul_triton(gate_up), silu_mul_triton.reference(gate_up))


@interpreted_only
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 12),
    dim=st.integers(1, 300) | st.just(1024),
    dtype=st.sampled_from(DTYPES),
    weighted=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_add_rms_norm_matches_its_reference(rows, dim, dtype, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = ((torch.randn(rows, dim, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.rand(dim, generator=g) + 0.5 if weighted else None
    assert add_norm_error(rms_norm_triton, x, r, w, 1e-6) <= TOL[dtype]


@interpreted_only
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 12),
    width=st.integers(1, 300) | st.just(1500),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 10_000),
)
def test_silu_and_mul_matches_its_reference(rows, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    assert silu_error(silu_mul_triton, gate_up) <= TOL[dtype]


@interpreted_only
def test_strided_inputs_and_the_cuda_kernels():
    """Views into wider tensors; the ops' registered CUDA kernels take them and run Triton."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=g)[:, 1]
    r = torch.randn(4, 40, generator=g)[::2]
    w = torch.rand(40, generator=g) + 0.5
    assert add_norm_error(rms_norm_triton, x, r, w, 1e-6) <= TOL[torch.float32]
    got = rms_norm_triton._add_cuda(x, r, w, 1e-6)
    assert (
        max(error(a, b) for a, b in zip(got, rms_norm_triton.add_reference(x, r, w, 1e-6), strict=True))
        <= 2e-6
    )
    gate_up = torch.randn(3, 50, generator=g)[:, 4:44]
    assert silu_error(silu_mul_triton, gate_up) <= TOL[torch.float32]
    assert error(silu_mul_triton._cuda(gate_up), silu_mul_triton.reference(gate_up)) <= 2e-6


@interpreted_only
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutated_kernels_fail(mutant, tmp_path):
    file, line, wrong = MUTANTS[mutant]
    module = mutant_of(Path(rms_norm_triton.__file__).with_name(file), line, wrong, tmp_path, mutant)
    g = torch.Generator().manual_seed(2)
    if file == "rms_norm_triton.py":
        x, r = (torch.randn(16, 96, generator=g) for _ in range(2))
        w = torch.rand(96, generator=g) + 0.5
        assert add_norm_error(module, x, r, w, 1e-6) > 100 * TOL[torch.float32]
    else:
        gate_up = torch.randn(16, 192, generator=g) * 4
        assert silu_error(module, gate_up) > 100 * TOL[torch.float32]


def test_layers_call_the_ops_only_on_eager_device_steps(monkeypatch):
    """The CPU keeps its path (the C++ kernels, else the plain form); an eager step on another
    device (meta here) calls each op; autograd keeps the plain form."""
    from deepinfer.cache.forward_batch import ForwardBatch

    calls = []
    add_op, silu_op = norms.add_rms_norm, dispatch.silu_mul_triton.silu_and_mul

    def adding(x, *args):
        calls.append(("add_rms_norm", x.device.type))
        return add_op(x, *args)

    def silu(x):
        calls.append(("silu_and_mul", x.device.type))
        return silu_op(x)

    monkeypatch.setattr(norms, "add_rms_norm", adding)
    monkeypatch.setattr(dispatch.silu_mul_triton, "silu_and_mul", silu)
    for device, grad in (("cpu", False), ("meta", False), ("meta", True)):
        norm = norms.RMSNorm(8, 1e-6).to(device)
        rows = torch.zeros(2, dtype=torch.long, device=device)
        batch = ForwardBatch(
            pools=[], window_idx=rows[:, None], window_valid=rows[:, None] >= 0, window_write=rows
        )
        x = torch.ones(2, 8, device=device, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            dispatch.add_rms_norm(norm, x, torch.ones(2, 8, device=device), batch)
            dispatch.silu_and_mul(torch.ones(2, 16, device=device, requires_grad=grad), batch)
    assert calls == [("add_rms_norm", "meta"), ("silu_and_mul", "meta")]
