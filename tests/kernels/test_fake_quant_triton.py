"""``deepinfer::fake_quant`` (``kernels/fake_quant_triton.py``): its default is the QAT fake
quantisation's plain formula (``models/layers/fake_quant.py``), bit for bit; the Triton
kernel, run by Triton's interpreter on CPU tensors, gives the same bits on random shapes,
block sizes, formats, dtypes and magnitudes, and on the edges (scales just above a power of
two, where fp32 ``log2`` rounds back; ties of the e4m3 and e2m1 grids; saturated e4m3 scales;
e4m3 subnormals; zero blocks); kernels that round the scale exactly, round ties away, skip a
saturation, drop e4m3's subnormals, ignore the amax floor or lose the sign fail the same
check; and the fake-quant functions call the op only on eager non-CPU steps without autograd.

Triton decides between compiling and interpreting when it decorates a kernel, so the
interpreted checks run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``); in this process they are skipped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from deepinfer.kernels import fake_quant_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, mutant_of, run_in_interpreter

from deepinfer.models.layers import fake_quant as layer

KERNEL_FILE = Path(fake_quant_triton.__file__)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the op's formats -> the layer's plain function
PLAIN: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "fp8_pow2": layer.fake_quant_fp8_pow2,
    "fp4_pow2": layer.fake_quant_fp4_pow2,
    "fp4_e4m3": layer.fake_quant_fp4_e4m3_scale,
}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# source line -> its mutant: each must fail ``check``
MUTANTS = {
    "exact_log2": ("tl.minimum(f * 1.4426950408889634, 0.5)", "tl.where(f > 0, 0.5, 0.0)"),
    "scale_ties_away": (
        "k += ((rest > 0.5) | ((rest == 0.5) & ((k & 1) == 1))).to(tl.int32)  # the scale's tie",
        "k += (rest >= 0.5).to(tl.int32)",
    ),
    "value_ties_away": (
        "k += ((rest > 0.5) | ((rest == 0.5) & ((k & 1) == 1))).to(tl.int32)  # a value's tie",
        "k += (rest >= 0.5).to(tl.int32)",
    ),
    "scale_unsaturated": ("r = tl.minimum(r, 448.0)", "r = tl.minimum(r, 3.0e38)"),
    "no_subnormals": (
        "ev = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)",
        "ev = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -7)",
    ),
    "floor_ignored": ("tl.maximum(amax, FLOOR)", "tl.maximum(amax, 1e-30)"),
    "sign_lost": ("& -2147483648  # copysign", "& 0  # copysign"),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_under_the_interpreter():
    run_in_interpreter(__file__)


def make_case(lead: tuple[int, ...], blocks: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations [*lead, blocks * block]: each block at its own magnitude (2^-24 to 2^13,
    an fp16-safe range), each value spread down to 2^-20 of it (e4m3 subnormals), a few exact
    zeros and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, blocks, block)
    magnitude = torch.exp2(torch.randint(-24, 14, (*lead, blocks, 1), generator=g).float())
    spread = torch.exp2(-20 * torch.rand(shape, generator=g) ** 3)
    x = torch.randn(shape, generator=g) * magnitude * spread
    x = torch.where(torch.rand(shape, generator=g) < 0.03, 0.0, x)
    x = torch.where(torch.rand(shape, generator=g) < 0.03, -0.0, x)
    return x.reshape(*lead, blocks * block).to(dtype)


def edge_cases() -> list[tuple[torch.Tensor, str, int]]:
    """Blocks whose scale or values sit on the formats' edges (fp32, 32-channel blocks)."""
    values = torch.linspace(-1, 1, 32)
    cases = []
    for fmt, qmax in (("fp8_pow2", 448.0), ("fp4_pow2", 6.0)):
        # amax a few ulps above qmax 2^e: fp32 log2 of amax / qmax rounds back to e for |e| >= 4
        base = torch.tensor([qmax * 2.0**e for e in range(-20, 100)]).view(torch.int32)
        amax = (base[:, None] + torch.arange(40)).view(torch.float32).flatten()
        x = amax[:, None] * values
        x[:, 0] = amax
        x[:, 1:4] = amax[:, None] * torch.tensor([3e-5, 1e-5, 5e-6])  # where e4m3's scale shows
        cases.append((x, fmt, 32))
    # e4m3 scales at grid ties, in the subnormal range and saturated (amax / 6 >= 448)
    grid = torch.tensor(
        [2.0**-9 * k for k in range(1, 16)] + [2.0**e * (1 + k / 8) for e in range(-6, 9) for k in range(8)]
    )
    ties = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([448.0, 460.0, 464.0, 500.0, 1e4])])
    x = 6 * ties[:, None] * values
    x[:, 0] = 6 * ties
    cases.append((x, "fp4_e4m3", 32))
    # values on and between the e2m1 and e4m3 grids (a block's amax pins the scale at 1)
    e2m1 = torch.arange(0, 6.25, 0.25)
    rows = torch.stack([torch.cat([e2m1, -e2m1])[:32], torch.cat([-e2m1, e2m1])[:32]])
    rows[:, 0] = 6.0
    cases.append((rows, "fp4_pow2", 32))
    e4m3 = torch.cat(
        [grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-11, -(2.0**-10)])]
    )
    e4m3 = torch.cat([e4m3, -e4m3])
    e4m3 = torch.cat([e4m3, torch.zeros(-e4m3.numel() % 32)]).view(-1, 32)
    e4m3[:, 0] = 448.0
    cases.append((e4m3, "fp8_pow2", 32))
    zero = torch.tensor([0.0, -0.0, 1e-30, -1e-30]).repeat(8).view(1, 32)
    cases += [(zero, fmt, 16) for fmt in PLAIN]
    return cases


def assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same shape, dtype and bits (-0 apart from 0)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    diff = got.view(INT_VIEW[got.dtype]) != want.view(INT_VIEW[want.dtype])
    assert not diff.any(), (got[diff][:8], want[diff][:8])


def check(module: ModuleType, x: torch.Tensor, fmt: str, block: int) -> None:
    assert module.takes(x, fmt, block)
    assert_bits(module.fake_quant_triton(x, fmt, block), PLAIN[fmt](x, block))


cases = st.tuples(
    st.lists(st.integers(0, 4), min_size=0, max_size=2).map(tuple),
    st.integers(1, 6),
    st.sampled_from([2, 8, 16, 32, 128]),
    st.sampled_from(DTYPES),
    st.integers(0, 2**16),
)


@settings(max_examples=40, deadline=None)
@given(case=cases, fmt=st.sampled_from(sorted(PLAIN)))
def test_default_is_the_plain_formula(case, fmt):
    x = make_case(*case)
    assert_bits(torch.ops.deepinfer.fake_quant(x, fmt, case[2]), PLAIN[fmt](x, case[2]))


def test_default_takes_the_edges_and_refuses_partial_blocks():
    for x, fmt, block in edge_cases():
        assert_bits(fake_quant_triton.fake_quant(x, fmt, block), PLAIN[fmt](x, block))
    with pytest.raises(ValueError):
        fake_quant_triton.fake_quant(torch.zeros(2, 40), "fp8_pow2", 32)
    with pytest.raises(ValueError):
        fake_quant_triton.fake_quant(torch.zeros(2, 32), "fp8_e5m2", 32)


def test_takes_only_what_the_kernel_reads():
    x = torch.zeros(3, 64)
    assert fake_quant_triton.takes(x, "fp4_e4m3", 16)
    assert not fake_quant_triton.takes(x.double(), "fp4_e4m3", 16)
    assert not fake_quant_triton.takes(x[:, ::2], "fp4_e4m3", 16)  # strided channels
    assert not fake_quant_triton.takes(x.t(), "fp4_e4m3", 1)  # not contiguous
    assert not fake_quant_triton.takes(x, "fp4_e4m3", 24)  # not a power of two
    assert not fake_quant_triton.takes(torch.zeros(2, 512), "fp8_pow2", 512)  # wider than MAX_BLOCK
    assert not fake_quant_triton.takes(x, "fp8_e5m2", 16)


@interpreted_only
@settings(max_examples=60, deadline=None)
@given(case=cases, fmt=st.sampled_from(sorted(PLAIN)))
def test_random_cases_match_the_formula(case, fmt):
    check(fake_quant_triton, make_case(*case), fmt, case[2])


@interpreted_only
def test_edges_match_the_formula():
    for x, fmt, block in edge_cases():
        for dtype in DTYPES if x.abs().max() < 6e4 else [torch.float32, torch.bfloat16]:
            check(fake_quant_triton, x.to(dtype), fmt, block)


@interpreted_only
def test_the_cuda_kernel_runs_it_and_falls_back():
    """The op's registered CUDA kernel runs the Triton kernel on what it takes and the plain
    formula on the rest (a strided view)."""
    x = make_case((3, 2), 4, 32, torch.bfloat16, 7)
    assert_bits(
        fake_quant_triton._cuda(x, "fp8_pow2", 32), fake_quant_triton.fake_quant_triton(x, "fp8_pow2", 32)
    )
    wide = torch.zeros(3, 2, 160, dtype=x.dtype).narrow(2, 16, 128).copy_(x)
    assert not fake_quant_triton.takes(wide, "fp4_pow2", 32)
    assert_bits(fake_quant_triton._cuda(wide, "fp4_pow2", 32), PLAIN["fp4_pow2"](x, 32))


@interpreted_only
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutated_kernels_fail(name, tmp_path):
    module = mutant_of(KERNEL_FILE, *MUTANTS[name], tmp_path, name)
    with pytest.raises(AssertionError):
        for fmt, block in (("fp8_pow2", 32), ("fp4_pow2", 16), ("fp4_e4m3", 16)):
            check(module, make_case((5,), 4, block, torch.float32, 3), fmt, block)
        for x, fmt, block in edge_cases():
            check(module, x, fmt, block)


def test_layers_call_the_op_only_on_eager_device_steps(monkeypatch):
    """CPU steps keep the formula; an eager step on another device (meta here) calls the op,
    for whole blocks only; autograd keeps the formula."""
    calls, op = [], fake_quant_triton.fake_quant

    def recording(x, fmt, block):
        calls.append((x.device.type, fmt, block))
        return op(x, fmt, block)

    monkeypatch.setattr(layer.fake_quant_triton, "fake_quant", recording)
    x = make_case((2,), 2, 32, torch.bfloat16, 1)
    for fmt, fn in PLAIN.items():
        assert_bits(fn(x, 32), fake_quant_triton.reference(x, fmt, 32))
    assert calls == []
    meta = x.to("meta")
    layer.fake_quant_fp8_pow2(meta)
    layer.fake_quant_fp4_pow2(meta)
    layer.fake_quant_fp4_e4m3_scale(meta)
    assert layer.fake_quant_fp8_pow2(meta[:, :40]) is not None  # 40 channels: left alone
    with torch.enable_grad():
        layer.fake_quant_fp4_pow2(meta.float().requires_grad_(True))
    assert calls == [("meta", "fp8_pow2", 32), ("meta", "fp4_pow2", 32), ("meta", "fp4_e4m3", 16)]
