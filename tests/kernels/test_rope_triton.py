"""``deepinfer::rope_store`` (``kernels/rope_triton.py``): its reference is the layers' plain
RoPE + cache-write path; the Triton kernel, run by Triton's interpreter on CPU tensors,
matches that reference on random shapes and dtypes; kernels with a flipped sign, halves
swapped or keys written at the token's row instead of its pool row fail the same check; and
the layers call the op only on eager non-CPU steps.

Triton decides between compiling and interpreting when it decorates a kernel, so the
interpreted checks run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``); in this process they are skipped."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from deepinfer.kernels import kv_int8, rope_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, mutant_of, run_in_interpreter

from deepinfer.models.layers.rope import rotate_half_rope

KERNEL_FILE = Path(rope_triton.__file__)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# source line -> its mutant: each must fail ``check``
MUTANTS = {
    "sign_flipped": ("lo = (a * c - b * s)", "lo = (a * c + b * s)"),
    "halves_swapped": ("hi = (b * c + a * s)", "hi = (a * c + b * s)"),
    "token_row_not_pool_row": ("dst = k_ptr + row * k_stride", "dst = k_ptr + t * k_stride"),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_under_the_interpreter():
    run_in_interpreter(__file__)


def make_case(tokens: int, n_kv: int, group: int, half: int, act: torch.dtype, pool: torch.dtype, seed: int):
    """A step's fused projection, angles and distinct pool rows among spare ones."""
    g = torch.Generator().manual_seed(seed)
    heads, d = n_kv * group, 2 * half
    qkv = (torch.randn(tokens, (heads + 2 * n_kv) * d, generator=g) * 3).to(act)
    angles = torch.rand(tokens, half, generator=g) * 100
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    pool_rows = tokens + 5
    rows = torch.randperm(pool_rows, generator=g)[:tokens]
    k_pool = torch.randn(pool_rows, n_kv * d, generator=g).to(pool)
    v_pool = torch.randn(pool_rows, n_kv * d, generator=g).to(pool)
    return qkv, cos, sin, rows, k_pool, v_pool, heads, n_kv, d


def run(fn, case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv, cos, sin, rows, k_pool, v_pool, *dims = case
    k, v = k_pool.clone(), v_pool.clone()
    q = fn(qkv, cos, sin, rows, k, v, *dims)
    return q, k, v


def plain_path(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``dispatch.rope_and_store`` computes for a float pool without the op."""
    qkv, cos, sin, rows, k_pool, v_pool, heads, n_kv, d = case
    t = qkv.shape[0]
    qk = rotate_half_rope(qkv[:, : (heads + n_kv) * d].reshape(t, -1, d), cos, sin)
    k, v = k_pool.clone(), v_pool.clone()
    k.index_copy_(0, rows, qk[:, heads:].reshape(t, -1).to(k.dtype))
    v.index_copy_(0, rows, qkv[:, (heads + n_kv) * d :].to(v.dtype))
    return qk[:, :heads], k, v


def test_reference_is_the_plain_path():
    case = make_case(5, 2, 3, 8, torch.bfloat16, torch.float16, seed=0)
    for got, want in zip(run(rope_triton.reference, case), plain_path(case), strict=True):
        assert torch.equal(got, want)
    q, k, v = run(torch.ops.deepinfer.rope_store, case)
    assert q.is_contiguous() and torch.equal(q, plain_path(case)[0])


def assert_matches(got: torch.Tensor, want: torch.Tensor, rounded_to_bf16: bool) -> None:
    """Bit for bit, unless a value went through bf16 (the activations or this tensor): then
    within one bf16 step of it (the interpreter truncates fp32 -> bf16 where a GPU rounds to
    nearest)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if rounded_to_bf16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


def check(module: ModuleType, case) -> None:
    outs = zip(run(module.rope_store_triton, case), plain_path(case), strict=True)
    for got, want in outs:
        assert_matches(got, want, torch.bfloat16 in (case[0].dtype, got.dtype))


@interpreted_only
@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 6),
    n_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    half=st.sampled_from([1, 3, 8, 20, 64]),
    act=st.sampled_from(DTYPES),
    pool=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_the_plain_path(tokens, n_kv, group, half, act, pool, seed):
    check(rope_triton, make_case(tokens, n_kv, group, half, act, pool, seed))


@interpreted_only
def test_strided_inputs_and_the_cuda_kernel():
    """A projection's view into a wider tensor, rows read with a stride, angles as the model
    makes them; the op's registered CUDA kernel takes these tensors and runs the kernel."""
    qkv, cos, sin, rows, k_pool, v_pool, *dims = make_case(4, 2, 2, 16, torch.float32, torch.float32, 1)
    wide = torch.zeros(4, qkv.shape[1] + 7).narrow(1, 3, qkv.shape[1]).copy_(qkv)
    strided_rows = torch.stack([rows, rows], 1)[:, 0]
    case = (wide, cos, sin, strided_rows, k_pool, v_pool, *dims)
    check(rope_triton, case)
    assert rope_triton.takes(wide, cos, k_pool, v_pool)
    for got, want in zip(run(rope_triton._cuda, case), plain_path(case), strict=True):
        assert_matches(got, want, rounded_to_bf16=False)


@interpreted_only
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutated_kernels_fail(name, tmp_path):
    module = mutant_of(KERNEL_FILE, *MUTANTS[name], tmp_path, name)
    with pytest.raises(AssertionError):
        check(module, make_case(3, 2, 2, 8, torch.float32, torch.float32, seed=2))


def test_layers_call_the_op_only_on_eager_device_steps(monkeypatch):
    """CPU steps keep their path; an eager step on another device (meta here) calls the op;
    8-bit pools, which hold keys in a rotated basis, and autograd keep the plain path."""
    from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
    from deepinfer.models.layers import dispatch

    calls, op = [], rope_triton.rope_store

    def recording(qkv, *args):
        calls.append(qkv.device.type)
        return op(qkv, *args)

    monkeypatch.setattr(dispatch.rope_triton, "rope_store", recording)
    qkv, cos, sin, rows, _, _, *dims = make_case(2, 1, 2, 16, torch.float32, torch.float32, 3)
    for device, pool_dtype, grad in (
        ("cpu", torch.float32, False),
        ("meta", torch.bfloat16, False),
        ("meta", torch.int8, False),
        ("meta", torch.float32, True),
    ):
        width = kv_int8.row_width(32, pool_dtype)
        pools = LayerPools(
            window=torch.zeros(8, width, dtype=pool_dtype, device=device),
            values=torch.zeros(8, width, dtype=pool_dtype, device=device),
        )
        on = rows.to(device)
        batch = ForwardBatch(
            pools=[pools], window_idx=on[:, None], window_valid=on[:, None] >= 0, window_write=on
        )
        x = qkv.to(device).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            dispatch.rope_and_store(x, cos.to(device), sin.to(device), pools, batch, *dims)
    assert calls == ["meta"]
