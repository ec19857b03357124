"""``deepinfer::interleaved_rope`` (``kernels/interleaved_rope_triton.py``): its default is
V4's plain formula (``kernels/rope.py``), backwards with ``-sin``; the Triton kernel, run by
Triton's interpreter on CPU tensors, matches it on random shapes, dtypes and positions, bit
for bit in fp32; kernels with a flipped sign, the pair's channels swapped or the unrotated
channels skipped fail the same check; and ``apply_rope`` calls the op only on eager non-CPU
steps without autograd.

Triton decides between compiling and interpreting when it decorates a kernel, so the
interpreted checks run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``); in this process they are skipped."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from deepinfer.kernels import interleaved_rope_triton
from deepinfer.kernels.rope import interleaved_rope
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, mutant_of, run_in_interpreter

from deepinfer.models.layers import rope as layer_rope
from deepinfer.models.layers.rope import Rotary, YarnParams

KERNEL_FILE = Path(interleaved_rope_triton.__file__)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# source line -> its mutant: each must fail ``check``
MUTANTS = {
    "sign_flipped": ("lo = e * c - o * s", "lo = e * c + o * s"),
    "pair_swapped": ("hi = o * c + e * s", "hi = e * c + o * s"),
    "inverse_ignored": ("s = s * SIGN", "s = s * 1.0"),
    "nope_skipped": ("tl.store(dst + k, tl.load(src + k, mask=keep), mask=keep)", "pass"),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_under_the_interpreter():
    run_in_interpreter(__file__)


def make_case(tokens: int, heads: int, nope: int, half: int, dtype: torch.dtype, seed: int, yarn: bool):
    """Activations [T, H, D] (H = 0: [T, D]) and the model's angles at random positions."""
    g = torch.Generator().manual_seed(seed)
    lead = (tokens, heads) if heads else (tokens,)
    x = (torch.randn(*lead, nope + 2 * half, generator=g) * 3).to(dtype)
    rotary = Rotary(2 * half, 160000.0, YarnParams(4.0, 1024) if yarn else None)
    cos, sin = rotary(torch.randint(0, 70000, (tokens,), generator=g))
    if heads:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x, cos, sin


def plain(x, cos, sin, inverse: bool) -> torch.Tensor:
    """What the layers computed before the op: the formula, with ``-sin`` to undo."""
    return interleaved_rope(x, cos, -sin if inverse else sin)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, unless the values went through bf16: then within one bf16 step (the
    interpreter truncates fp32 -> bf16 where a GPU rounds to nearest)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)
    else:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def check(module: ModuleType, case, inverse: bool) -> None:
    x, cos, sin = case
    assert module.takes(x, cos, sin)
    assert_matches(module.rope_triton(x, cos, sin, inverse), plain(x, cos, sin, inverse))


def test_default_is_the_plain_formula():
    for inverse in (False, True):
        for heads in (0, 3):
            x, cos, sin = make_case(4, heads, 8, 4, torch.bfloat16, 0, yarn=True)
            got = torch.ops.deepinfer.interleaved_rope(x, cos, sin, inverse)
            assert got.is_contiguous() and torch.equal(got, plain(x, cos, sin, inverse))


def test_takes_only_what_the_kernel_reads():
    x, cos, sin = make_case(3, 2, 4, 4, torch.float32, 0, yarn=False)
    assert interleaved_rope_triton.takes(x, cos, sin)
    assert not interleaved_rope_triton.takes(x.double(), cos, sin)
    assert not interleaved_rope_triton.takes(x, cos.double(), sin)
    assert not interleaved_rope_triton.takes(x[..., ::2], cos, sin)  # strided channels
    assert not interleaved_rope_triton.takes(x[None], cos, sin)  # 4-D
    assert not interleaved_rope_triton.takes(x, cos.expand(3, 5, 4), sin.expand(3, 5, 4))  # widens x
    assert not interleaved_rope_triton.takes(x[..., :6], cos, sin)  # rope wider than the head


@interpreted_only
@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 5),
    heads=st.sampled_from([0, 1, 3, 8]),
    nope=st.sampled_from([0, 1, 16, 48, 1100]),
    half=st.sampled_from([1, 3, 8, 32]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    yarn=st.booleans(),
    inverse=st.booleans(),
)
def test_random_cases_match_the_formula(tokens, heads, nope, half, dtype, seed, yarn, inverse):
    check(interleaved_rope_triton, make_case(tokens, heads, nope, half, dtype, seed, yarn), inverse)


@interpreted_only
def test_strided_inputs_and_the_cuda_kernel():
    """A projection's view into a wider tensor and per-token angles for a 2-D input; the
    op's registered CUDA kernel takes these tensors and runs the kernel."""
    x, cos, sin = make_case(4, 2, 40, 8, torch.float32, 1, yarn=True)
    wide = torch.zeros(4, 2, x.shape[-1] + 5).narrow(2, 3, x.shape[-1]).copy_(x)
    check(interleaved_rope_triton, (wide, cos, sin), inverse=True)
    flat, cos2, sin2 = make_case(3, 0, 16, 8, torch.bfloat16, 2, yarn=False)
    check(interleaved_rope_triton, (flat, cos2, sin2), inverse=False)
    assert_matches(interleaved_rope_triton._cuda(wide, cos, sin, False), plain(wide, cos, sin, False))


@interpreted_only
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutated_kernels_fail(name, tmp_path):
    module = mutant_of(KERNEL_FILE, *MUTANTS[name], tmp_path, name)
    with pytest.raises(AssertionError):
        for inverse in (False, True):
            check(module, make_case(3, 2, 16, 8, torch.float32, 2, yarn=True), inverse)


def test_layers_call_the_op_only_on_eager_device_steps(monkeypatch):
    """CPU steps keep the formula; an eager step on another device (meta here) calls the op,
    backwards too; autograd keeps the formula."""
    calls, op = [], interleaved_rope_triton.rope

    def recording(x, cos, sin, inverse):
        calls.append((x.device.type, inverse))
        return op(x, cos, sin, inverse)

    monkeypatch.setattr(layer_rope.interleaved_rope_triton, "rope", recording)
    x, cos, sin = make_case(2, 3, 8, 4, torch.float32, 3, yarn=False)
    cpu = layer_rope.apply_rope(x, cos, sin, inverse=True)
    assert torch.equal(cpu, plain(x, cos, sin, inverse=True))
    meta = [t.to("meta") for t in (x, cos, sin)]
    layer_rope.apply_rope(*meta)
    layer_rope.apply_rope(*meta, inverse=True)
    with torch.enable_grad():
        layer_rope.apply_rope(meta[0].requires_grad_(True), *meta[1:])
    assert calls == [("meta", False), ("meta", True)]
