"""``deepinfer::hc_pre`` / ``hc_post`` (``kernels/mhc_triton.py``): their plain forms are the
model's mHC functions, bit for bit; the blocks call the ops only on eager non-CPU steps; the
Triton kernels, run by Triton's interpreter on CPU tensors, match the plain forms on random
shapes and dtypes; and kernels that ignore the lagged mix, stop one Sinkhorn iteration short
or mix with comb untransposed fail the same comparison.

The interpreter checks run in a fresh process: the interpreter is chosen when a kernel is
defined, and other tests in this process may have defined them without it."""

from __future__ import annotations

import torch
from deepinfer.kernels import mhc_triton
from triton_interpreter import run_code_in_interpreter

from deepinfer.models.layers import mhc


def _block(n: int = 4, d: int = 24, seed: int = 0) -> mhc.HyperConnectedBlock:
    g = torch.Generator().manual_seed(seed)
    block = mhc.HyperConnectedBlock(d, n, 1e-6, 20, 1e-6)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1 + (p.shape == (3,))
    return block


def test_plain_forms_are_the_models():
    """On the CPU the blocks run the plain form, which is each op's default implementation:
    a step's bits cannot depend on which of the two ran."""
    block = _block()
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(5, 4, 24, generator=g).bfloat16()
    lagged = torch.rand(5, 4, generator=g)
    with torch.no_grad():
        for site, collapse_with in (("attn", None), ("ffn", lagged)):
            pre, post, comb = block.mixes(streams, site)
            x = mhc.hc_collapse(streams, pre if collapse_with is None else collapse_with)
            got = block.pre(streams, site, collapse_with)
            fn, base, scale = (getattr(block, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
            op = torch.ops.deepinfer.hc_pre(streams, fn, base, scale, collapse_with, 20, 1e-6, 1e-6)
            for a, b, c in zip(got, (x, pre, post, comb), op, strict=True):
                assert torch.equal(a, b) and torch.equal(a, c)
            y = torch.randn(5, 24, generator=g).bfloat16()
            plain = mhc.hc_expand(y, streams, post, comb)
            assert torch.equal(plain, torch.ops.deepinfer.hc_post(y, streams, post, comb))


def test_blocks_call_the_ops_only_on_eager_device_steps():
    calls = []
    saved = mhc_triton.hc_pre, mhc_triton.hc_post

    def recording(name, real):
        def op(*args):
            calls.append((name, args[0].device.type))
            return real(*args)

        return op

    mhc_triton.hc_pre, mhc_triton.hc_post = recording("pre", saved[0]), recording("post", saved[1])
    try:
        cpu, on_device = _block(), _block().to("meta")
        with torch.no_grad():
            cpu.pre(torch.ones(2, 4, 24), "attn")  # CPU: plain
            mhc.hc_expand(torch.ones(2, 24), torch.ones(2, 4, 24), torch.ones(2, 4), torch.ones(2, 4, 4))
            on_device.pre(torch.ones(2, 4, 24, device="meta"), "ffn")
            meta = {"device": "meta"}
            mhc.hc_expand(
                torch.ones(2, 24, **meta),
                torch.ones(2, 4, 24, **meta),
                torch.ones(2, 4, **meta),
                torch.ones(2, 4, 4, **meta),
            )
        on_device.hc_attn_fn.requires_grad_(True)
        on_device.pre(torch.ones(2, 4, 24, device="meta"), "attn")  # autograd: plain
    finally:
        mhc_triton.hc_pre, mhc_triton.hc_post = saved
    assert calls == [("pre", "meta"), ("post", "meta")]


_PRELUDE = """
import torch
from deepinfer.kernels import mhc_triton as m

# relative to |value| + 1; the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so
# bf16 results may sit two bf16 steps (2 ** -7 each) from the plain form's
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-5, torch.float16: 2e-3}


def error(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
    if not ref.numel():
        return 0.0
    return ((got.float() - ref.float()).abs() / (ref.float().abs() + 1)).max().item()


def case(lead, n, d, dtype, lagged, seed, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(*lead, n, d, generator=g) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * sharp / (n * d) ** 0.5
    base = torch.randn((2 + n) * n, generator=g) * 0.3
    scale = torch.rand(3, generator=g) + 0.5
    with_ = torch.rand(*lead, n, generator=g) if lagged else None
    y = (torch.randn(*lead, d, generator=g) * 2).to(dtype)
    return streams, fn, base, scale, with_, y
"""


def test_kernels_match_the_plain_forms_on_random_cases():
    """Hypothesis: 0 to 9 tokens (one or two leading dims), 1 to 6 streams, widths 1 to 300
    (crossing the 256-wide chunks), fp32 / bf16 / fp16, own or lagged collapse mix, 1 to 20
    Sinkhorn iterations; the CUDA entry points pick the kernels."""
    run_code_in_interpreter(
        _PRELUDE
        + """
from hypothesis import given, settings, strategies as st


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    lead=st.sampled_from([(0,), (1,), (3,), (9,), (2, 3)]),
    n=st.integers(1, 6),
    d=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    lagged=st.booleans(),
    iters=st.integers(1, 20),
    seed=st.integers(0, 10_000),
)
def check(lead, n, d, dtype, lagged, iters, seed):
    streams, fn, base, scale, with_, y = case(lead, n, d, dtype, lagged, seed)
    got = m.pre_triton(streams, fn, base, scale, with_, iters, 1e-6, 1e-6)
    ref = m.pre_reference(streams, fn, base, scale, with_, iters, 1e-6, 1e-6)
    assert error(got[0], ref[0]) <= TOL[dtype], (lead, n, d, dtype, "x")
    for a, b in zip(got[1:], ref[1:]):
        assert error(a, b) <= 1e-5, (lead, n, d, dtype, iters)
    out = m.post_triton(y, streams, ref[2], ref[3])
    assert error(out, m.expand(y, streams, ref[2], ref[3])) <= TOL[dtype], (lead, n, d, dtype, "post")


check()

calls = []
real_pre, real_post = m.pre_triton, m.post_triton
m.pre_triton = lambda *a: calls.append("pre") or real_pre(*a)
m.post_triton = lambda *a: calls.append("post") or real_post(*a)
streams, fn, base, scale, with_, y = case((3,), 4, 40, torch.bfloat16, True, 0)
pre, post, comb = m.mixes(streams, fn, base, scale, 20, 1e-6, 1e-6)
m._pre_cuda(streams, fn, base, scale, with_, 20, 1e-6, 1e-6)
m._post_cuda(y, streams, post, comb)
assert calls == ["pre", "post"], calls
m._pre_cuda(streams, fn.double(), base, scale, with_, 20, 1e-6, 1e-6)  # fp64 mixing rows: plain
m._post_cuda(y.float(), streams, post, comb)  # y in another dtype: plain
many = torch.zeros(m.MAX_TOKENS + 1, 4, 40, dtype=torch.bfloat16)
m._pre_cuda(many, fn, base, scale, None, 20, 1e-6, 1e-6)  # a prefill's tokens: plain
assert calls == ["pre", "post"], calls
print("ok")
"""
    )


def test_wrong_kernels_fail_the_comparison():
    """Mutation checks: the collapse with the site's own mix where a lagged one was given,
    Sinkhorn one iteration short on unconverged logits, and the expand with comb untransposed
    are each far outside the tolerance (and the right calls inside it)."""
    run_code_in_interpreter(
        _PRELUDE
        + """
streams, fn, base, scale, with_, y = case((5,), 4, 64, torch.float32, True, 3, sharp=20.0)
ref = m.pre_reference(streams, fn, base, scale, with_, 3, 1e-6, 1e-6)
good = m.pre_triton(streams, fn, base, scale, with_, 3, 1e-6, 1e-6)
assert max(error(a, b) for a, b in zip(good, ref)) <= 1e-5
own = m.pre_triton(streams, fn, base, scale, None, 3, 1e-6, 1e-6)
assert error(own[0], ref[0]) > 100 * TOL[torch.float32]
short = m.pre_triton(streams, fn, base, scale, with_, 2, 1e-6, 1e-6)
assert error(short[3], ref[3]) > 1e-3
post, comb = ref[2], ref[3]
expected = m.expand(y, streams, post, comb)
assert error(m.post_triton(y, streams, post, comb), expected) <= TOL[torch.float32]
flipped = m.post_triton(y, streams, post, comb.transpose(-1, -2))
assert error(flipped, expected) > 100 * TOL[torch.float32]
print("ok")
"""
    )
