"""``deepinfer::rms_norm`` (``kernels/rms_norm_triton.py``): its reference is the model's
plain norm, bit for bit; the Triton kernel, run by Triton's interpreter on CPU tensors,
matches it on random shapes and dtypes, with and without a weight; a kernel that drops the
weight or the eps fails the same comparison; and the model's norms call the op only on eager
non-CPU steps."""

from __future__ import annotations

import torch
from deepinfer.kernels.rms_norm_triton import reference
from triton_interpreter import run_code_in_interpreter

from deepinfer.models.layers import norms


def test_reference_is_the_models_plain_norm():
    """On the CPU the layers run the plain form: the op's reference is the same code path,
    so a step's bits cannot depend on which of the two ran."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 48, generator=g).bfloat16()
    norm = norms.RMSNorm(48, 1e-6)
    norm.weight.data = torch.rand(48, generator=g) + 0.5
    assert torch.equal(norm(x), reference(x, norm.weight, 1e-6))
    assert torch.equal(norms.unweighted_rms_norm(x, 1e-6), reference(x, None, 1e-6))
    assert torch.equal(torch.ops.deepinfer.rms_norm(x, norm.weight, 1e-6), norm(x))


def test_layers_call_the_op_only_on_eager_device_steps():
    calls = []

    def recording(x, weight, eps):
        calls.append(x.device.type)
        return reference(x, weight, eps)

    norm, on_device = norms.RMSNorm(8, 1e-6), norms.RMSNorm(8, 1e-6).to("meta")
    saved = norms.rms_norm
    norms.rms_norm = recording
    try:
        with torch.no_grad():
            norm(torch.ones(2, 8))  # CPU: plain
            on_device(torch.ones(2, 8, device="meta"))
            norms.unweighted_rms_norm(torch.ones(2, 8, device="meta"), 1e-6)
        on_device.weight.requires_grad_(True)
        on_device(torch.ones(2, 8, device="meta"))  # autograd: plain
    finally:
        norms.rms_norm = saved
    assert calls == ["meta", "meta"]


def test_triton_kernel_under_the_interpreter():
    """Hypothesis: rows 0 to 40, widths 1 to 300 (no power of two) and 1,024, fp32 / bf16 /
    fp16, with or without weight. Mutation: the kernel without its weight, or with eps 0
    on rows of small values, is far outside the tolerance."""
    code = """
import torch
from hypothesis import given, settings, strategies as st
from deepinfer.kernels.rms_norm_triton import reference, rms_norm_triton
from deepinfer.kernels import rms_norm_triton as module

# relative to |value| + 1; the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so
# bf16 results may sit two bf16 steps (2 ** -7 each) from the reference's
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-5, torch.float16: 2e-3}


def error(x, w, eps, kernel_w="same", kernel_eps=None):
    got = rms_norm_triton(x, w if kernel_w == "same" else kernel_w, eps if kernel_eps is None else kernel_eps)
    ref = reference(x, w, eps)
    assert got.shape == x.shape and got.dtype == x.dtype
    if not x.numel():
        return 0.0
    return ((got.float() - ref.float()).abs() / (ref.float().abs() + 1)).max().item()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 40),
    dim=st.integers(1, 300) | st.just(1024),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    weighted=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-3]),
    seed=st.integers(0, 10_000),
)
def check(rows, dim, dtype, weighted, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.rand(dim, generator=g) + 0.5 if weighted else None
    assert error(x, w, eps) <= TOL[dtype], (rows, dim, dtype, weighted)


check()
g = torch.Generator().manual_seed(1)
x = torch.randn(2, 3, 40, generator=g)[:, 1]  # a strided view
w = torch.rand(40, generator=g) + 0.5
assert error(x, w, 1e-6) <= TOL[torch.float32]
assert module.takes(x) and not module.takes(torch.ones(2, module.MAX_DIM + 1))
assert error(x, w, 1e-6, kernel_w=None) > 100 * TOL[torch.float32]
small = torch.randn(4, 64, generator=g) * 1e-3
assert error(small, w[:1].expand(64).contiguous(), 1e-6) <= TOL[torch.float32]
assert error(small, w[:1].expand(64).contiguous(), 1e-6, kernel_eps=0.0) > 100 * TOL[torch.float32]
print("ok")
"""
    run_code_in_interpreter(code)
