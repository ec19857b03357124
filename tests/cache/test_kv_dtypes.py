"""fp8 K/V cache (``kv_cache_dtype="fp8"`` / ``"fp8_e5m2"``): the stored bits and the values
read back, in the CPU kernels and in the engine."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from deepinfer.kernels.cpu import build as cpu_build
from equivalence_workloads import alone_runner, count_preemptions, together
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache_checks import close, count_kernel_calls, greedy_logprobs, rounded_twin

from deepinfer import LLM
from deepinfer.cache import kv_dtypes
from deepinfer.tiny import make_tiny_checkpoint

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# test entry points over the kernels' fp8 helpers: n codes widened a vector at a time, n
# values narrowed one at a time
_PROBE = r"""
#define PROBE(NAME, T)                                                                   \
  extern "C" void widen_##NAME(const T* codes, float* out, int64_t n) {                  \
    for (int64_t i = 0; i < n; i += at::vec::Vectorized<float>::size())                  \
      fp8_load<T>(codes + i).store(out + i);                                             \
  }                                                                                      \
  extern "C" void narrow_##NAME(const float* x, T* out, int64_t n) {                     \
    for (int64_t i = 0; i < n; ++i) out[i] = to_pool<T>(x[i]);                           \
  }
PROBE(e4m3, c10::Float8_e4m3fn)
PROBE(e5m2, c10::Float8_e5m2)
"""


def _probe(source: str = cpu_build.source("fp8.h")) -> ctypes.CDLL:
    lib = cpu_build.load(source + _PROBE)
    assert lib is not None
    for name in FP8:
        cpu_build.bind(lib, f"widen_{name}", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
        cpu_build.bind(lib, f"narrow_{name}", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
    return lib


def _widened(lib: ctypes.CDLL, name: str) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    getattr(lib, f"widen_{name}")(codes.data_ptr(), out.data_ptr(), 256)
    return out


def _narrowed(lib: ctypes.CDLL, name: str, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8)
    getattr(lib, f"narrow_{name}")(x.data_ptr(), out.data_ptr(), x.numel())
    return out


# the build for this CPU, and (on an AVX-512 CPU) the AVX2 line too: the ISA macro the build
# defines is overridden, so ATen's vectors and the helpers take their AVX2 branch
BUILDS = {"native": "", "avx2": "#undef CPU_CAPABILITY_AVX512\n#define CPU_CAPABILITY_AVX2\n"}
VECTOR_BUILD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(scope="module", params=sorted(BUILDS))
def probe(request) -> ctypes.CDLL:
    if request.param == "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the native build is the AVX2 one (or this CPU has no AVX2)")
    return _probe(BUILDS[request.param] + cpu_build.source("fp8.h"))


@pytest.mark.parametrize("name", sorted(FP8))
def test_the_kernels_widen_every_fp8_code_exactly(probe, name):
    """All 256 codes (subnormals, zeros of both signs, the largest values, NaN codes and, in
    e5m2, infinities) widen in the kernels' vector loads to what ATen's conversion gives."""
    want = torch.arange(256, dtype=torch.uint8).view(FP8[name]).float()
    got = _widened(probe, name)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 too


def _values_to_narrow(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every code's value, the midpoints between neighbouring codes (round-to-even ties) and
    values just beside them, values past the range, infinities, NaN and random ones."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = codes[codes.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(seed)
    top = kv_dtypes.FP8_MAX[dtype]
    return torch.cat(
        [
            grid,
            mid,
            torch.nextafter(mid, torch.full_like(mid, math.inf)),
            torch.nextafter(mid, torch.full_like(mid, -math.inf)),
            torch.tensor([top * 1.03, -top * 1.07, 1e30, -1e30, math.inf, -math.inf, math.nan, -0.0]),
            torch.randn(2000, generator=gen) * torch.rand(2000, generator=gen).mul(20).sub(12).exp2(),
        ]
    )


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(sorted(FP8)))
def test_the_kernels_store_the_bits_the_python_writes_store(probe, seed, name):
    """The kernels' fp8 stores (saturating, then round to nearest even) equal ``kv_dtypes``'
    on every code's value, the ties between neighbouring codes and values beside them,
    values past the range and non-finite ones."""
    dtype = FP8[name]
    x = _values_to_narrow(dtype, seed)
    want = kv_dtypes.to_pool(x, dtype).view(torch.uint8)
    assert torch.equal(_narrowed(probe, name, x), want)
    stored = kv_dtypes.to_pool(x, dtype).float()
    top = kv_dtypes.FP8_MAX[dtype]
    assert stored[x.isfinite()].abs().max().item() == top  # saturated, never NaN or inf
    assert torch.equal(stored[x.isinf()], torch.tensor([top, -top]))


@pytest.mark.parametrize(
    "mutation",
    [
        ("set1_ps(256.f)", "set1_ps(128.f)"),  # e4m3 exponents rebased wrongly (AVX-512 and AVX2 lines)
        ("x = x > top ? top : (x < -top ? -top : x);", ""),  # no saturation
    ],
)
@pytest.mark.skipif(not VECTOR_BUILD, reason="the rebase mutated lives in the x86 vector lines")
def test_broken_fp8_helpers_fail_the_checks(mutation):
    """Mutation check for the two tests above: a wrong exponent rebase fails the widening
    check, and stores without saturation fail the narrowing one."""
    source = cpu_build.source("fp8.h").replace(*mutation)
    assert source != cpu_build.source("fp8.h")
    broken = _probe(source)
    if "top" in mutation[0]:  # (c10's e4m3fn conversion saturates by itself; e5m2's does not)
        x = _values_to_narrow(torch.float8_e5m2, 0)
        want = kv_dtypes.to_pool(x, torch.float8_e5m2).view(torch.uint8)
        assert not torch.equal(_narrowed(broken, "e5m2", x), want)
    else:
        want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        finite = ~want.isnan()
        assert not torch.equal(_widened(broken, "e4m3")[finite], want[finite])


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_an_fp8_cache_computes_with_the_values_it_stores(arch, kv, tmp_path, monkeypatch):
    """An fp8 cache (its kernels: the one-call Llama stack, RoPE + writes, in-place attention)
    gives the tokens and logprobs of an fp32 cache whose writes round every value through the
    same fp8 format, on the Python write path (for Llama, with queries and keys in the rotated
    basis); a quarter of the fp32 cache's bytes for Llama (V4 keeps its compressor state in
    fp32). Mutation check for Llama: the twin rounding unrotated keys differs."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 258, (int(n),), generator=gen).tolist() for n in (5, 17, 30)]
    fp8 = LLM(path, kv_cache_dtype=kv, enable_prefix_caching=False)
    dtype = kv_dtypes.KV_CACHE_DTYPES[kv]
    assert all(p.window.dtype == dtype for p in fp8.engine.runner.pools)
    if arch == "llama":  # the C++ paths must really run on the fp8 pools
        calls = count_kernel_calls(fp8, monkeypatch)
    got = greedy_logprobs(fp8, prompts)
    if arch == "llama":
        layout = fp8.engine.layout
        assert layout.block_bytes(dtype) * 4 == layout.block_bytes(torch.float32)
        assert calls["stack"] > 0
        fp8.engine.runner.forward.stack = None  # the layer path's kernels too
        assert greedy_logprobs(fp8, prompts) == got and calls["attention"] > 0
        monkeypatch.undo()

    # the check can fail: without the rounding, other logprobs
    unrounded = greedy_logprobs(rounded_twin(path, monkeypatch, None), prompts)
    assert any(
        max(abs(a - b) for a, b in zip(x[1], y[1], strict=True)) > 1e-3
        for x, y in zip(got, unrounded, strict=True)
    )

    def fp8(values: torch.Tensor) -> torch.Tensor:
        return kv_dtypes.to_pool(values, dtype).float()

    rotated = arch == "llama"  # a Llama cache holds keys in the rotated basis (kv_rotation)
    want = greedy_logprobs(rounded_twin(path, monkeypatch, fp8, rotated=rotated), prompts)
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(got, want, strict=True):
        assert tokens == tokens_ref
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(logprobs_ref), rtol=0, atol=1e-4)
    if rotated:
        monkeypatch.undo()
        assert not close(got, greedy_logprobs(rounded_twin(path, monkeypatch, fp8), prompts), 1e-4)


@pytest.mark.parametrize(("arch", "blocks", "budget"), [("llama", 48, 96), ("deepseek_v4", 8, 256)])
def test_batching_chunking_preemption_and_prefix_hits_are_invisible_with_an_fp8_cache(
    arch, blocks, budget, tmp_path
):
    """Greedy outputs of a random workload run together (chunked prefill, preemption from a
    small cache, shared prefixes served from the prefix cache) equal each request alone, on
    an fp8 cache: its rows are rounded once, when written, whatever step reads them."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=4)
    reference = alone_runner(path, num_requests=40, kv_cache_dtype="fp8")(5, True)
    llm = LLM(
        path, kv_cache_dtype="fp8", num_cache_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=16
    )
    preempted = count_preemptions(llm)
    assert together(llm, 5, True, num_requests=40) == reference
    assert preempted and llm.engine.block_pools[0].hit_blocks > 0
