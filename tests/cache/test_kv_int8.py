"""int8 K/V cache (``kv_cache_dtype="int8"``): the row format against its definition, the
kernels' loads and stores, and the engine computing with exactly the values it stores."""

from __future__ import annotations

import ctypes

import pytest
import torch
from deepinfer.kernels import kv_int8
from deepinfer.kernels.cpu import build as cpu_build
from equivalence_workloads import alone_runner, count_preemptions, together
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache_checks import close, count_kernel_calls, greedy_logprobs, rounded_twin

from deepinfer import LLM
from deepinfer.tiny import make_tiny_checkpoint

# test entry points over int8_rows.h: n codes widened a vector at a time; a row encoded
_PROBE = r"""
extern "C" void widen(const int8_t* codes, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += at::vec::Vectorized<float>::size()) i8_load(codes + i).store(out + i);
}
extern "C" void encode(int8_t* row, const float* x, int64_t n) { i8_store_row(row, x, n); }
"""
BUILDS = {"native": "", "avx2": "#undef CPU_CAPABILITY_AVX512\n#define CPU_CAPABILITY_AVX2\n"}


def _probe(source: str) -> ctypes.CDLL:
    lib = cpu_build.load(source + _PROBE)
    assert lib is not None
    cpu_build.bind(lib, "widen", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
    cpu_build.bind(lib, "encode", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
    return lib


@pytest.fixture(scope="module", params=sorted(BUILDS))
def probe(request) -> ctypes.CDLL:
    if request.param == "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the native build is the AVX2 one (or this CPU has no AVX2)")
    return _probe(BUILDS[request.param] + cpu_build.source("int8_rows.h"))


def _kernel_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    out = torch.zeros(x.shape[0], kv_int8.row_width(x.shape[1], torch.int8), dtype=torch.int8)
    for i in range(x.shape[0]):
        lib.encode(out[i].data_ptr(), x[i].data_ptr(), x.shape[1])
    return out


def _blocks(draw_seed: int, rows: int, blocks: int) -> torch.Tensor:
    """Rows of 32-value blocks at magnitudes far apart, with all-zero blocks and exact ties
    (values at half a step between two codes)."""
    gen = torch.Generator().manual_seed(draw_seed)
    x = (
        torch.randn(rows, blocks, 32, generator=gen)
        * torch.rand(rows, blocks, 1, generator=gen).mul(30).sub(15).exp2()
    )
    x[torch.rand(rows, blocks, generator=gen) < 0.1] = 0.0
    tie = torch.rand(rows, blocks, generator=gen) < 0.2  # amax 127 -> scale 1: k + 0.5 are ties
    ties = torch.randint(-126, 126, (rows, blocks, 32), generator=gen).float() + 0.5
    ties[..., 0] = 127.0
    x = torch.where(tie.unsqueeze(-1), ties, x)
    return x.view(rows, blocks * 32)


def _definition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the format's definition says a row holds, written apart from ``kv_int8``: per
    block of 32, s = max|x| / 127 and codes round-half-even(x / s) (0 for a zero block)."""
    codes, scales = [], []
    for block in x.float().split(32, dim=-1):
        s = block.abs().amax(dim=-1, keepdim=True) / 127
        q = torch.zeros_like(block)
        nz = s.squeeze(-1) > 0
        q[nz] = torch.round(block[nz] / s[nz])
        codes.append(q)
        scales.append(s)
    return torch.cat(codes, dim=-1), torch.cat(scales, dim=-1)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), blocks=st.integers(1, 6))
def test_rows_hold_the_codes_and_scales_of_the_definition(probe, seed, rows, blocks):
    """``encode`` and the kernels' row store give the definition's codes and scales bit for
    bit (ties to even, zero blocks), and ``read`` gives codes times scales: within half a
    step of every value."""
    x = _blocks(seed, rows, blocks)
    codes, scales = _definition(x)
    dim = x.shape[1]
    stored = kv_int8.encode(x)
    assert stored.shape == (rows, dim + dim // 32 * 4)
    assert torch.equal(stored[:, :dim].float(), codes)
    assert torch.equal(stored[:, dim:].contiguous().view(torch.float32), scales)
    assert torch.equal(_kernel_rows(probe, x), stored)
    back = kv_int8.read(stored, torch.float32)
    step = scales.repeat_interleave(32, dim=-1)
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-6))
    assert torch.equal(back, codes * step)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_kernels_widen_every_code_exactly(probe, seed):
    """All 256 int8 codes (and a random mix) widen in the kernels' vector loads to their
    values."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.arange(-128, 128), torch.randint(-128, 128, (64,), generator=gen)]).to(
        torch.int8
    )
    out = torch.empty(codes.numel())
    probe.widen(codes.data_ptr(), out.data_ptr(), codes.numel())
    assert torch.equal(out, codes.float())


@pytest.mark.parametrize(
    "mutation",
    [
        ("std::nearbyint(x[i] / s)", "std::trunc(x[i] / s)"),  # truncation, not rounding
        ("amax / 127.f", "amax / 128.f"),  # a scale that never reaches the largest code
        ("_mm512_cvtepi8_epi32", "_mm512_cvtepu8_epi32"),  # codes read unsigned (AVX-512 line)
        ("_mm256_cvtepi8_epi32", "_mm256_cvtepu8_epi32"),  # codes read unsigned (AVX2 line)
    ],
)
def test_broken_int8_helpers_fail_the_checks(mutation):
    """Mutation check for the two tests above: rounding by truncation or a wrong scale fails
    the store check; reading codes as unsigned fails the widening check."""
    base = cpu_build.source("int8_rows.h")
    line = BUILDS["avx2"] if "mm256" in mutation[0] else ""
    if line and torch.backends.cpu.get_cpu_capability() != "AVX512":
        line = ""
    if "mm512" in mutation[0] and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the AVX-512 line is not built on this CPU")
    source = line + base.replace(*mutation)
    assert source != line + base
    broken = _probe(source)
    x = _blocks(1, 4, 3)
    codes = torch.arange(-128, 128).to(torch.int8)
    out = torch.empty(256)
    broken.widen(codes.data_ptr(), out.data_ptr(), 256)
    assert not (torch.equal(_kernel_rows(broken, x), kv_int8.encode(x)) and torch.equal(out, codes.float()))


def test_an_int8_cache_computes_with_the_values_it_stores(tmp_path, monkeypatch):
    """An int8 cache, through its kernels (the one-call Llama stack, RoPE + writes, in-place
    decode and prefill attention), gives the tokens and logprobs (1e-4) of an fp32 cache whose
    writes round every row through the format's definition on the Python path, with queries
    and keys meeting in the Hadamard basis (``kv_rotation``); its blocks take 9/32 of the fp32 cache's
    bytes. Mutation checks: rounding with one scale per 64 values instead of 32, or rounding
    the keys unrotated, moves the logprobs past the tolerance."""
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", seed=3, head_dim=32, hidden_size=128)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 258, (int(n),), generator=gen).tolist() for n in (5, 17, 30, 41)]
    llm = LLM(path, kv_cache_dtype="int8", enable_prefix_caching=False)
    assert all(p.window.dtype == torch.int8 for p in llm.engine.runner.pools)
    layout = llm.engine.layout
    assert layout.block_bytes(torch.int8) * 32 == layout.block_bytes(torch.float32) * 9
    calls = count_kernel_calls(llm, monkeypatch)
    got = greedy_logprobs(llm, prompts)
    assert calls["stack"] > 0
    llm.engine.runner.forward.stack = None  # the layer path's kernels too
    assert greedy_logprobs(llm, prompts) == got and calls["attention"] > 0
    monkeypatch.undo()

    def definition(values: torch.Tensor) -> torch.Tensor:
        codes, scales = _definition(values)
        return codes * scales.repeat_interleave(32, dim=-1)

    def wide_blocks(values: torch.Tensor) -> torch.Tensor:  # the mutation: 64 values per scale
        n, dim = values.shape
        g = values.float().view(n, dim // 64, 64)
        s = g.abs().amax(-1, keepdim=True) / 127
        return (torch.where(s > 0, g / s, 0.0).round() * s).view(n, dim)

    assert close(
        got, greedy_logprobs(rounded_twin(path, monkeypatch, definition, rotated=True), prompts), 1e-4
    )
    monkeypatch.undo()
    assert not close(
        got, greedy_logprobs(rounded_twin(path, monkeypatch, wide_blocks, rotated=True), prompts), 1e-4
    )
    monkeypatch.undo()
    assert not close(got, greedy_logprobs(rounded_twin(path, monkeypatch, definition), prompts), 1e-4)


def test_batching_chunking_preemption_and_prefix_hits_are_invisible_with_an_int8_cache(tmp_path):
    """Greedy outputs of a random workload run together (chunked prefill, preemption from a
    small cache, shared prefixes served from the prefix cache) equal each request alone, on
    an int8 cache: a row is encoded once, when written, whatever step reads it."""
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", seed=4, head_dim=32, hidden_size=128)
    reference = alone_runner(path, num_requests=40, kv_cache_dtype="int8")(5, True)
    llm = LLM(path, kv_cache_dtype="int8", num_cache_blocks=48, max_num_batched_tokens=96, max_num_seqs=16)
    preempted = count_preemptions(llm)
    assert together(llm, 5, True, num_requests=40) == reference
    assert preempted and llm.engine.block_pools[0].hit_blocks > 0


def test_an_int8_cache_is_refused_where_rows_have_no_reader(tmp_path):
    """DeepSeek-V4's windowed and compressed rows have no int8 reader: a clear error, not
    wrong attention; a row width off the 32-value blocks is refused too."""
    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4", seed=1)
    with pytest.raises(ValueError, match="int8"):
        LLM(path, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="blocks of 32"):
        kv_int8.row_width(48, torch.int8)
