"""``deepinfer::moe_gate`` (``kernels/moe_gate_triton.py``): its plain form is the model's
router, bit for bit; the router calls the op only on eager non-CPU steps without routing
replay; the Triton kernel, run by Triton's interpreter on CPU tensors, matches the plain
form on random shapes, dtypes, scoring functions and hash tables; and a kernel that skips the
bias or the normalisation fails the same comparison.

The interpreter checks run in a fresh process: the interpreter is chosen when a kernel is
defined, and other tests in this process may have defined it without it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer.kernels import moe_gate_triton
from triton_interpreter import run_code_in_interpreter

from deepinfer.models.layers import moe


def _gate(hashed: bool, scoring: str = "sqrtsoftplus", experts: int = 12, k: int = 3) -> moe.Gate:
    cfg = SimpleNamespace(
        num_experts_per_tok=k,
        scoring_func=scoring,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        n_routed_experts=experts,
        hidden_size=16,
        vocab_size=20,
    )
    gate = moe.Gate(cfg, hashed)
    g = torch.Generator().manual_seed(0)
    gate.weight.data = torch.randn(experts, 16, generator=g)
    if hashed:
        gate.tid2eid = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(20)])
    else:
        gate.bias.data = torch.randn(experts, generator=g) * 0.1
    return gate


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", moe_gate_triton.SCORING)
def test_plain_form_is_the_models_router(hashed, scoring):
    gate = _gate(hashed, scoring)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 16, generator=g).bfloat16()
    ids_in = torch.randint(0, 20, (7,), generator=g)
    with torch.no_grad():
        weights, ids = gate(x, ids_in)
        logits = torch.nn.functional.linear(x, gate.weight.to(x.dtype))
        bias = None if hashed else gate.bias
        table = gate.tid2eid if hashed else None
        op = torch.ops.deepinfer.moe_gate(logits, bias, table, ids_in, 3, scoring, True, 1.5)
    assert torch.equal(weights, op[0]) and torch.equal(ids, op[1])


def test_router_calls_the_op_only_on_eager_device_steps():
    calls = []
    saved = moe_gate_triton.moe_gate

    def recording(logits, *args):
        calls.append(logits.device.type)
        return saved(logits, *args)

    moe_gate_triton.moe_gate = recording
    try:
        cpu, on_device = _gate(False), _gate(False).to("meta")
        with torch.no_grad():
            cpu(torch.ones(2, 16), torch.zeros(2, dtype=torch.long))  # CPU: plain
            on_device(torch.ones(2, 16, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"))
            replay = SimpleNamespace(route=lambda ids: ids)
            on_device(torch.ones(2, 16, device="meta"), None, replay)  # routing replay: plain
        on_device.bias.requires_grad_(True)
        on_device(torch.ones(2, 16, device="meta"), None)  # autograd: plain
    finally:
        moe_gate_triton.moe_gate = saved
    assert calls == ["meta"]


_PRELUDE = """
import torch
from deepinfer.kernels import moe_gate_triton as m

# relative to |value| + 1; the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so
# bf16 results may sit a few bf16 steps (2 ** -7 each) from the plain form's
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-5, torch.float16: 2e-3}


def case(n, experts, k, dtype, scoring, hashed, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, experts, generator=g) * 3).to(dtype)
    bias = None if hashed else torch.randn(experts, generator=g) * 0.2
    table = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(9)]) if hashed else None
    ids_in = torch.randint(0, 9, (n,), generator=g) if hashed else None
    return logits, bias, table, ids_in


def error(got, ref, scoring, normalize):
    \"\"\"Largest relative weight error; ties in the biased scores may pick another expert
    of the same score, so the kernel's choice is checked by its biased score and its weights
    against the plain form's weights of the experts it chose.\"\"\"
    (w, ids), (rw, rids) = got, ref
    logits, bias, table, ids_in, k, scale = case_args
    assert w.shape == rw.shape and w.dtype == rw.dtype and ids.dtype == torch.long
    if not w.numel():
        return 0.0
    s = m.scores(logits, scoring)
    biased = s.float() + (0.0 if bias is None else bias)
    if table is None:
        picked = biased.gather(1, ids).sort(dim=-1).values
        wanted = biased.gather(1, rids).sort(dim=-1).values
        assert torch.equal(picked, wanted), (picked, wanted)
    else:
        assert torch.equal(ids, rids)
    expected = m.weigh(s, ids, normalize, scale)
    return ((w.float() - expected.float()).abs() / (expected.float().abs() + 1)).max().item()
"""


def test_kernel_matches_the_plain_form_on_random_cases():
    """Hypothesis: 0 to 9 tokens, 1 to 300 experts (no power of two), k from 1 to 8, fp32 /
    bf16 / fp16 logits, each scoring function, hashed or biased top-k, with and without the
    normalisation; the CUDA entry point picks the kernel."""
    run_code_in_interpreter(
        _PRELUDE
        + """
from hypothesis import given, settings, strategies as st


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    n=st.integers(0, 9),
    experts=st.integers(1, 300),
    k=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scoring=st.sampled_from(m.SCORING),
    hashed=st.booleans(),
    normalize=st.booleans(),
    seed=st.integers(0, 10_000),
)
def check(n, experts, k, dtype, scoring, hashed, normalize, seed):
    global case_args
    k = min(k, experts)
    logits, bias, table, ids_in = case(n, experts, k, dtype, scoring, hashed, seed)
    case_args = (logits, bias, table, ids_in, k, 2.5)
    got = m.moe_gate_triton(logits, bias, table, ids_in, k, scoring, normalize, 2.5)
    ref = m.reference(logits, bias, table, ids_in, k, scoring, normalize, 2.5)
    assert error(got, ref, scoring, normalize) <= TOL[dtype], (n, experts, k, dtype, scoring, hashed)


check()

calls = []
real = m.moe_gate_triton
m.moe_gate_triton = lambda *a: calls.append(1) or real(*a)
logits, bias, table, ids_in = case(3, 16, 4, torch.bfloat16, "sigmoid", False, 0)
m._cuda(logits, bias, None, None, 4, "sigmoid", True, 1.0)
assert calls == [1]
m._cuda(logits, bias.double(), None, None, 4, "sigmoid", True, 1.0)  # an fp64 bias: plain
m._cuda(logits, bias, None, None, 4, "relu", True, 1.0)  # unknown scoring: plain
assert calls == [1]
print("ok")
"""
    )


def test_wrong_kernels_fail_the_comparison():
    """Mutation checks: the top-k without the bias chooses other experts, and weights left
    unnormalised are far outside the tolerance (the right calls inside it)."""
    run_code_in_interpreter(
        _PRELUDE
        + """
logits, bias, table, ids_in = case(6, 64, 6, torch.float32, "sqrtsoftplus", False, 5)
bias = bias * 20  # a bias that moves the choice
case_args = (logits, bias, table, ids_in, 6, 2.5)
ref = m.reference(logits, bias, None, None, 6, "sqrtsoftplus", True, 2.5)
good = m.moe_gate_triton(logits, bias, None, None, 6, "sqrtsoftplus", True, 2.5)
assert error(good, ref, "sqrtsoftplus", True) <= TOL[torch.float32]
unbiased = m.moe_gate_triton(logits, None, None, None, 6, "sqrtsoftplus", True, 2.5)
assert not torch.equal(unbiased[1].sort(dim=-1).values, ref[1].sort(dim=-1).values)
raw = m.moe_gate_triton(logits, bias, None, None, 6, "sqrtsoftplus", False, 2.5)
assert (raw[0] - m.weigh(m.scores(logits, "sqrtsoftplus"), raw[1], True, 2.5)).abs().max() > 1e-2
print("ok")
"""
    )
