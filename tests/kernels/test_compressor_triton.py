"""``deepinfer::compress_groups`` (``kernels/compressor_triton.py``): its default is the
compressor's plain step (the layer's CPU path gives the same bits through it); the two Triton
kernels, run by Triton's interpreter on CPU tensors, match it on random cases (overlap or
not, restores into overlap rows read this step, dtypes): the state rows bit for bit, the
pooled groups to rounding; kernels that ignore a restore, pool the wrong half or write the
wrong state row fail the same check; and the layer calls the op only on eager non-CPU steps
that keep state.

Triton decides between compiling and interpreting when it decorates a kernel, so the
interpreted checks run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``); in this process they are skipped."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from deepinfer.kernels import compressor_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, mutant_of, run_in_interpreter

from deepinfer.cache.forward_batch import CompressorPools, ForwardBatch, GroupMeta
from deepinfer.models.layers import compressor as layer
from deepinfer.models.layers.rope import Rotary

BATCH = ForwardBatch(pools=[], window_idx=None, window_valid=None, window_write=None)
KERNEL_FILE = Path(compressor_triton.__file__)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POOLS = ("buf_kv", "buf_gate", "ovl_kv", "ovl_gate", "snap_kv", "snap_gate")
# source line -> its mutant: each must fail ``check``
MUTANTS = {
    "restore_ignored": ("            if last >= 0:", "            if last >= 1 << 30:"),
    "wrong_half": ("offset = tl.where(own, d, 0)", "offset = tl.where(own, 0, d)"),
    "wrong_state_row": (
        "r = tl.load(ovl_dst + (k - n_buf)).to(tl.int64)",
        "r = tl.load(ovl_dst + 0).to(tl.int64)",
    ),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_under_the_interpreter():
    run_in_interpreter(__file__)


def make_case(tokens: int, ratio: int, width: int, overlap: bool, dtype: torch.dtype, ape: bool, seed: int):
    """A step's projections, state pools and row bookkeeping: distinct destination rows,
    restores into overlap rows some of which the step reads."""
    g = torch.Generator().manual_seed(seed)
    slots, blocks = 3, 2

    def rand(*shape, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * 2).to(dt)

    def pick(n: int, high: int) -> torch.Tensor:
        return torch.randperm(high, generator=g)[:n]

    kv, gate = rand(tokens, width, dt=dtype), rand(tokens, width, dt=dtype)
    pools = {name: rand((blocks if "snap" in name else slots) * ratio, width) for name in POOLS}
    if not overlap:
        pools.update({name: None for name in POOLS[2:]})
    n_buf = int(torch.randint(0, slots * ratio + 1, (), generator=g))
    n_ovl = int(torch.randint(0, slots * ratio + 1, (), generator=g)) if overlap else 0
    n_src = tokens + n_buf + n_ovl
    groups = int(torch.randint(0, 4, (), generator=g))
    src_ovl = pick(n_ovl, slots * ratio)
    restore_dst = torch.cat([src_ovl[:2], pick(2, slots * ratio)]).unique()[:3] if overlap else pick(0, 1)
    rows = [
        pick(n_buf, slots * ratio),
        src_ovl,
        torch.randint(0, n_src, (groups, ratio), generator=g),
        torch.randint(-1, n_src, (groups, ratio), generator=g),
        torch.randint(0, tokens, (min(tokens, slots * ratio),), generator=g),
        pick(min(tokens, slots * ratio), slots * ratio),
        torch.randint(0, n_src, (ratio if overlap else 0,), generator=g),
        pick(ratio if overlap else 0, slots * ratio),
        torch.randint(0, n_src, (ratio if overlap else 0,), generator=g),
        pick(ratio if overlap else 0, blocks * ratio),
        torch.randint(0, blocks * ratio, (restore_dst.numel(),), generator=g),
        restore_dst,
    ]
    return kv, gate, rand(ratio, width) if ape else None, pools, rows


def run(fn, case) -> tuple[torch.Tensor, dict]:
    kv, gate, ape, pools, rows = case
    fresh = {name: None if p is None else p.clone() for name, p in pools.items()}
    pooled = fn(kv, gate, ape, *(fresh[name] for name in POOLS), rows)
    return pooled, fresh


def check(module: ModuleType, case) -> None:
    got, got_pools = run(module.compress_triton, case)
    want, want_pools = run(compressor_triton.reference, case)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(
        got.float(), want.float(), atol=1e-5, rtol=1e-5 if want.dtype == torch.float32 else 2**-7
    )
    for name in POOLS:
        a, b = got_pools[name], want_pools[name]
        assert (a is None and b is None) or torch.equal(a, b), name


def layer_case(overlap: bool, seed: int = 0):
    """A compressor layer with random weights and ``make_case``'s state as its step's."""
    torch.manual_seed(seed)
    ratio, d, hidden = 4, 16, 24
    comp = layer.Compressor(hidden, d, ratio, overlap, 1e-6, Rotary(8, 10000.0, None))
    for p in comp.parameters():
        p.data = torch.randn(p.shape) * 0.5
    _, _, _, pools, rows = make_case(3, ratio, comp.width, overlap, torch.float32, True, seed)
    names = [f.name for f in GroupMeta.__dataclass_fields__.values()]
    g = rows[2].shape[0]
    extra = {"group_pos": torch.arange(g) * ratio, "entry_slot": torch.arange(g)}
    extra |= {
        "entry_idx": torch.zeros(3, 1, dtype=torch.long),
        "entry_valid": torch.ones(3, 1, dtype=torch.bool),
    }
    order = ["src_buf_rows", "src_ovl_rows", "group_rows", "prev_rows", "buf_src", "buf_dst", "ovl_src"]
    order += ["ovl_dst", "snap_src", "snap_dst", "restore_src", "restore_dst"]
    meta = GroupMeta(**dict(zip(order, rows, strict=True)), **extra)
    assert sorted(names) == sorted([*order, *extra])
    state = CompressorPools(**{n: p for n, p in pools.items()})
    return comp, torch.randn(3, hidden), state, meta


@pytest.mark.parametrize("overlap", [True, False])
def test_default_is_the_layers_plain_step(overlap, monkeypatch):
    """The layer's plain CPU step and the op's default (the layer's fused branch, run on the
    CPU) give the same latents, entries and state, bit for bit."""
    results = []
    for fused in (False, True):
        comp, x, state, meta = layer_case(overlap)
        monkeypatch.setattr(layer, "runs_fused", lambda *t, fused=fused: fused)
        out = torch.zeros(8, comp.out_dim)
        with torch.no_grad():
            latent, entries = comp(x, state, meta, out, BATCH)
        results.append((latent, entries, [getattr(state, n) for n in POOLS]))
    (a_lat, a_out, a_pools), (b_lat, b_out, b_pools) = results
    assert (a_lat is None and b_lat is None) or torch.equal(a_lat, b_lat)
    assert torch.equal(a_out, b_out)
    for a, b in zip(a_pools, b_pools, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_layer_calls_the_op_only_on_eager_device_steps(monkeypatch):
    calls = []
    op = compressor_triton.compress_groups

    def recording(kv, *args):
        calls.append(kv.device.type)
        return op(kv, *args)

    monkeypatch.setattr(layer.compressor_triton, "compress_groups", recording)
    comp, x, state, meta = layer_case(True)
    with torch.no_grad():
        comp(x, state, meta, torch.zeros(8, comp.out_dim), BATCH)  # CPU: plain
    assert calls == []
    assert layer.runs_fused(x.to("meta")) and not layer.runs_fused(x)
    with torch.enable_grad():
        assert not layer.runs_fused(x.to("meta").requires_grad_(True))


@interpreted_only
@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 5),
    ratio=st.sampled_from([1, 2, 4, 8]),
    half=st.sampled_from([1, 8, 40, 300]),
    overlap=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    ape=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_cases_match_the_plain_step(tokens, ratio, half, overlap, dtype, ape, seed):
    width = 2 * half if overlap else half
    check(compressor_triton, make_case(tokens, ratio, width, overlap, dtype, ape, seed))


@interpreted_only
def test_the_cuda_kernel_takes_a_step():
    case = make_case(3, 4, 32, True, torch.bfloat16, True, 5)
    kv, gate, ape, pools, rows = case
    assert compressor_triton.takes(kv, gate, pools["buf_kv"], pools["ovl_kv"], pools["snap_kv"], rows)
    got, got_pools = run(compressor_triton._cuda, case)
    want, want_pools = run(compressor_triton.compress_triton, case)
    assert torch.equal(got, want) and all(torch.equal(got_pools[n], want_pools[n]) for n in POOLS)


@interpreted_only
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutated_kernels_fail(name, tmp_path):
    module = mutant_of(KERNEL_FILE, *MUTANTS[name], tmp_path, name)
    with pytest.raises(AssertionError):
        for seed in range(4):
            check(module, make_case(4, 4, 32, True, torch.float32, True, seed))
