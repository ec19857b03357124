"""The Triton paged decode kernel (``kernels/paged_decode_triton.py``) under Triton's
interpreter on CPU tensors, against the gather path it replaces on CUDA.

Triton decides between compiling and interpreting when it decorates a kernel, its own library
functions (``tl.sum``, ``tl.cdiv``) included, so the checks run in a child pytest started with
``TRITON_INTERPRET=1`` (``test_kernel_under_the_interpreter``); in this process they are
skipped. The mutants are copies of the kernel module whose source differs in the loop bound:
each must fail ``check_all``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import INTERPRETED, interpreted_only, load_module, run_in_interpreter

pytest.importorskip("triton")

from deepinfer.kernels import paged_attention  # noqa: E402

KERNEL_FILE = Path(paged_attention.__file__).with_name("paged_decode_triton.py")
LOOP_BOUND = "range(0, tl.cdiv(seq_len, BLOCK))"
MUTANTS = {
    "one_tile_too_few": "range(0, tl.cdiv(seq_len, BLOCK) - 1)",
    "drops_partial_tile": "range(0, seq_len // BLOCK)",
    "masks_past_the_length": "range(0, tl.cdiv(n_pos, BLOCK))",  # right values, wasted loads
}


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_under_the_interpreter():
    run_in_interpreter(__file__)


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    from deepinfer.kernels import paged_decode_triton

    return paged_decode_triton


@dataclass
class Case:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    decode_rows: torch.Tensor
    decode_kv: torch.Tensor
    decode_valid: torch.Tensor
    owned: torch.Tensor  # [pool rows] bool: rows some decode row reads (a position below its length)

    def args(self, k_pool: torch.Tensor | None = None, v_pool: torch.Tensor | None = None) -> tuple:
        k = self.k_pool if k_pool is None else k_pool
        v = self.v_pool if v_pool is None else v_pool
        return self.q, k, v, self.decode_rows, self.decode_kv, self.decode_valid


def make_case(
    lengths: list[int], n_pad: int, n_kv: int, group: int, d: int, bs: int, max_len: int, seed: int
) -> Case:
    """Decode rows of ``lengths`` (plus ``n_pad`` padded rows) over random, disjoint block
    tables, as ``full_attention_meta.build`` lays them out under ``StepPadding``: ``max_len``
    positions per row, those past a row's length pointing at the null block (the last)."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-max_len // bs)
    n_blocks = per_row * len(lengths) + 2
    null = n_blocks
    order = torch.randperm(n_blocks, generator=g)
    t = len(lengths) + n_pad + 1  # one token row no decode row covers
    h = n_kv * group
    q = torch.randn(t, h, d, generator=g)
    rows = n_blocks + 1
    k_pool = torch.randn(rows * bs, n_kv * d, generator=g)
    v_pool = torch.randn(rows * bs, n_kv * d, generator=g)
    pos = torch.arange(max_len)
    kv, valid = [], []
    owned = torch.zeros(rows * bs, dtype=torch.bool)
    for i, length in enumerate(lengths):
        table = order[i * per_row : (i + 1) * per_row]
        ok = pos < length
        row_kv = torch.where(ok, table[pos // bs] * bs + pos % bs, null * bs)
        owned[row_kv[ok]] = True
        kv.append(row_kv)
        valid.append(ok)
    for _ in range(n_pad):
        kv.append(torch.full((max_len,), null * bs))
        valid.append(torch.zeros(max_len, dtype=torch.bool))
    token_rows = torch.randperm(t, generator=g)[: len(lengths)]
    decode_rows = torch.cat([token_rows, torch.full((n_pad,), -1)])
    return Case(q, k_pool, v_pool, decode_rows, torch.stack(kv), torch.stack(valid), owned)


def reference(case: Case) -> torch.Tensor:
    q = case.q
    out = q.new_zeros(q.shape[0] + 1, *q.shape[1:])
    paged_attention.gather_decode_attention(*case.args(), out)
    return out[:-1]


def triton_out(module: ModuleType, case: Case, block: int, **pools: torch.Tensor) -> torch.Tensor:
    q = case.q
    out = q.new_zeros(q.shape[0] + 1, *q.shape[1:])
    module.decode_attention(*case.args(**pools), out, block=block)
    assert not out[-1].any()  # padded rows write nothing
    return out[:-1]


def check(module: ModuleType, case: Case, block: int) -> None:
    torch.testing.assert_close(triton_out(module, case, block), reference(case), atol=2e-5, rtol=1e-5)


# lengths 1, ending mid-block and exactly at a block end (block size 16), and one tile past it
EDGES = dict(lengths=[1, 21, 32, 17], n_pad=1, n_kv=2, group=2, d=16, bs=16, max_len=48, seed=0)


@interpreted_only
def test_edge_lengths_match_the_gather(kernel):
    case = make_case(**EDGES)
    check(kernel, case, block=16)
    t, h, d = case.q.shape  # q as the projection leaves it: a view into a wider tensor
    case.q = torch.zeros(t, h + 3, d).narrow(1, 0, h).copy_(case.q)
    check(kernel, case, block=16)


@interpreted_only
@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    n_pad=st.integers(0, 1),
    n_kv=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    d=st.sampled_from([16, 48, 64]),
    bs=st.sampled_from([8, 16]),
    block=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_random_tables_match_the_gather(kernel, lengths, n_pad, n_kv, group, d, bs, block, seed):
    case = make_case(lengths, n_pad, n_kv, group, d, bs, max_len=48, seed=seed)
    check(kernel, case, block)


@interpreted_only
def test_half_pools_match_the_gather(kernel):
    case = make_case(**EDGES)
    half = Case(*(x.half() if x.is_floating_point() else x for x in vars(case).values()))
    got = triton_out(kernel, half, block=16).float()
    torch.testing.assert_close(got, reference(case), atol=3e-2, rtol=3e-2)


@interpreted_only
def test_rows_past_a_length_are_never_read(kernel):
    """Every pool row no decode row owns below its length (the tail of a partly filled block,
    other blocks, the null block) holds NaN: a single load of one would poison the row."""
    case = make_case(**EDGES)
    k = case.k_pool.masked_fill(~case.owned[:, None], float("nan"))
    v = case.v_pool.masked_fill(~case.owned[:, None], float("nan"))
    got = triton_out(kernel, case, block=16, k_pool=k, v_pool=v)
    assert got.isfinite().all()
    torch.testing.assert_close(got, reference(case), atol=2e-5, rtol=1e-5)


def idle_loads(module: ModuleType, case: Case, block: int) -> int:
    """How many K, V or ``decode_kv`` loads the kernel issues with every lane masked off: a
    tile the loop reached past a row's length (skipped tiles issue none), counted by watching
    the interpreter's masked loads."""
    from triton.runtime import interpreter

    watched = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in case.args()[1:5]]
    idle = 0
    load = interpreter.InterpreterBuilder.create_masked_load

    def watching(self, ptrs, mask, *args):
        nonlocal idle
        start = int(ptrs.data.min())
        if any(lo <= start < hi for lo, hi in watched) and not mask.data.any():
            idle += 1
        return load(self, ptrs, mask, *args)

    with mock.patch.object(interpreter.InterpreterBuilder, "create_masked_load", watching):
        triton_out(module, case, block)
    return idle


def check_all(module: ModuleType) -> None:
    case = make_case(**EDGES)
    check(module, case, block=16)
    assert idle_loads(module, case, block=16) == 0


@interpreted_only
def test_tiles_past_a_length_are_skipped_not_masked(kernel):
    check_all(kernel)


@interpreted_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a mutant's empty rows: -inf - -inf
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutated_loop_bounds_fail(mutant, tmp_path):
    source = KERNEL_FILE.read_text()
    assert source.count(LOOP_BOUND) == 1
    path = tmp_path / f"{mutant}.py"
    path.write_text(source.replace(LOOP_BOUND, MUTANTS[mutant]))
    with pytest.raises(AssertionError):
        check_all(load_module(path, f"_paged_decode_{mutant}"))


@interpreted_only
def test_the_ops_cuda_kernel_runs_triton(kernel):
    """``deepinfer::paged_decode_attention``'s registered CUDA kernel takes these tensors and
    gives the Triton kernel's result (the dispatcher, not a device test, picks it)."""
    case = make_case(**EDGES)
    assert kernel.takes(case.q, case.k_pool, case.v_pool)
    out = case.q.new_zeros(case.q.shape[0] + 1, *case.q.shape[1:])
    paged_attention._decode_cuda(*case.args(), out)
    torch.testing.assert_close(out[:-1], reference(case), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[:-1], triton_out(kernel, case, block=64 if case.q.shape[-1] <= 128 else 32))


def test_the_ops_default_is_the_gather():
    """Devices without a kernel (and the CPU, when its C++ kernel does not serve the rows) run
    the gather, bit for bit."""
    case = make_case(**EDGES)
    out = case.q.new_zeros(case.q.shape[0] + 1, *case.q.shape[1:])
    torch.ops.deepinfer.paged_decode_attention(*case.args(), out)
    assert torch.equal(out[:-1], reference(case))


def test_the_launch_counter_sees_the_triton_kernel():
    """On meta tensors the reference's decode rows count as the op's CUDA kernel: one Triton
    launch (and the lengths' sum), not the gather's dozen."""
    from deepinfer.compile.launch_count import count_launches

    case = make_case(**EDGES)
    meta = [t.to("meta") for t in case.args()]
    spans = torch.zeros(0, 4, dtype=torch.long)
    count = count_launches(
        paged_attention.paged_attention_reference, *meta, spans, torch.zeros(0, dtype=torch.long)
    )
    assert count.outside["triton:_paged_decode"] == 1 and count.total <= 3, count.outside
