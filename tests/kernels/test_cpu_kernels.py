"""The C++ CPU kernels (``cpu_packed_gemm``, ``cpu_attention``, ``cpu_prefill_attention``, ...) against fp64
and PyTorch references on generated shapes, their batch invariance, the compiled op's run-time
kernel choice, and mutation checks that a broken kernel fails these tests. Their speed is
measured in benchmarks/cpu_decode.py."""

from __future__ import annotations

import ctypes

import kernel_builds
import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from deepinfer.kernels import kv_int8, kv_rotation, weight_only
from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import build as cpu_build
from deepinfer.kernels.cpu import decode_stack as cpu_decode_stack
from deepinfer.kernels.cpu import norm_act as cpu_norm_act
from deepinfer.kernels.cpu import packed_gemm as cpu_packed_gemm
from deepinfer.kernels.cpu import prefill_attention as cpu_prefill_attention
from deepinfer.kernels.cpu import rope_store as cpu_rope_store
from deepinfer.kernels.paged_attention import paged_attention_reference
from deepinfer.kernels.weight_only import PackedLinear, cpu_linear
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.cache import kv_dtypes
from deepinfer.cache.kv_dtypes import is_fp8
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import rotate_half_rope
from deepinfer.tiny import make_tiny_checkpoint

# every cache pool element type the CPU attention and cache-write kernels read
POOL_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
]


def _pool(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows holding ``values`` (int8: ``kv_int8`` rows, codes and per-32 scales)."""
    return kv_int8.encode(values) if dtype == torch.int8 else values.to(dtype)


def _int8_head(d: int, dtype: torch.dtype) -> int:
    """A head size the int8 kernels read (a multiple of the 32-value scale blocks)."""
    return max(32, d // 32 * 32) if dtype == torch.int8 else d


pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels' threaded paths, at any -n


@pytest.mark.parametrize("name", kernel_builds.kernel_sources())
def test_the_kernels_build_here(name: str, monkeypatch: pytest.MonkeyPatch):
    """CI machines have the C++ compiler Inductor needs, and every ``.cpp`` beside
    ``build.py`` builds in each build that reads it (the modules naming it: its ``ctypes``
    library, the op library compiling it in): a build failure must not pass quietly as a
    fallback."""
    assert cpu_build.compiler() is not None, "no C++ compiler: the kernels fall back to PyTorch's"
    modules = kernel_builds.builders(name)
    assert modules, f"no module builds {name}"
    for module in modules:
        built = kernel_builds.builds_of(module, name, monkeypatch)
        assert built, f"{module} names {name} but built no library from it"
        kernel_builds.require(all(built), f"{name} (built by {module})")


def _gemm_case(seed: int, rows: int, n: int, k: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    expected = x.double() @ w.double().T
    if b is not None:
        expected = expected + b.double()
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-5
    return x, w, b, expected, bound


def _int8_case(seed: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes [n, k], their fp16-valued scales [n, ceil(k / 32)] (some zero) and the
    weights they stand for."""
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, -(-k // 32), generator=gen) / 64).half().float()
    scales[torch.rand(scales.shape, generator=gen) < 0.1] = 0.0
    w = q.float() * scales.repeat_interleave(32, dim=1)[:, :k]
    return q, scales, w


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40) | st.integers(90, 200),  # and the rows-first order (8 MR = 96 rows up)
    n=st.integers(1, 70),
    k=st.integers(1, 200),
    bias=st.booleans(),
    weights=st.sampled_from(["fp32", "bf16", "int8"]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 10_000),
)
def test_packed_gemm_matches_fp64(rows, n, k, bias, weights, threads, seed):
    """Any shape (partial vector blocks, odd block counts, the rows left after the register
    passes, row ranges split over threads), fp32 or bf16 weights or int8 ones with an fp16
    scale per 32 inputs (a last group shorter where k is off the groups): the fp32 result is
    within fp32 summation error of the fp64 product of the weights as given (bf16 ones exactly
    widened, int8 ones times their group's scale)."""
    x, w, b, expected, bound = _gemm_case(seed, rows, n, k, bias)
    scale = None
    if weights == "bf16":
        w = w.bfloat16()
        expected = x.double() @ w.double().T + (0 if b is None else b.double())
    if weights == "int8":
        q, scales, w = _int8_case(seed, n, k)
        expected = x.double() @ w.double().T + (0 if b is None else b.double())
        bound = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-5
        scale, w = cpu_packed_gemm.pack_scales(scales), q
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = cpu_packed_gemm.pack(w)
        assert torch.equal(cpu_packed_gemm.unpack(packed, n), w)
        got = cpu_packed_gemm.gemm(x, packed, n, b, scale)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert (got.double() - expected).abs().max().item() <= bound


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 70),
    k=st.integers(1, 100),
    rows=st.integers(2, 80) | st.integers(90, 200),  # both loop orders (rows first from 96 rows)
    seed=st.integers(0, 10_000),
)
def test_packed_gemm_rows_do_not_depend_on_their_batch(n, k, rows, seed):
    """A row's result is bitwise the same alone, in any slice of the batch, or in the whole
    batch (one FMA chain per output whatever the row count): batch-invariant at every M."""
    x, w, b, _, _ = _gemm_case(seed, rows, n, k, True)
    packed = cpu_packed_gemm.pack(w)
    together = cpu_packed_gemm.gemm(x, packed, n, b)
    start = int(torch.randint(0, rows, (1,)))
    assert torch.equal(cpu_packed_gemm.gemm(x[start:], packed, n, b), together[start:])
    for i in range(rows):
        assert torch.equal(cpu_packed_gemm.gemm(x[i : i + 1], packed, n, b)[0], together[i])


# the packed GEMM's inline and template functions: a mutant renames them, or the dynamic linker may bind
# its calls to the same functions of a copy already loaded with global symbols (the compiled op's)
_PACKED_TEMPLATES = ("load_w", "load_scales", "tile", "tail", "passes", "rows_first", "packed_gemm")


def _packed_gemm_mutant(old: str, new: str) -> ctypes.CDLL:
    """The packed GEMM built from its source with ``old`` replaced by ``new`` and its templates
    renamed (a mutation check's kernel); asserts that the source changed."""
    good = cpu_build.source("packed_gemm.cpp")
    source = good.replace(old, new)
    assert source != good
    renames = "".join(f"#define {name} {name}_mutant\n" for name in _PACKED_TEMPLATES)
    source = source.replace("using Vec = ", renames + "using Vec = ", 1)
    broken = cpu_build.load(source)
    assert broken is not None
    return broken


def _broken_packed_gemm(old: str, new: str, symbol: str, x: torch.Tensor, w: torch.Tensor, threads: int):
    """``x @ w.T`` through the packed GEMM built from its source with ``old`` replaced by ``new``
    (a mutation check's kernel)."""
    broken = _packed_gemm_mutant(old, new)
    fn = cpu_build.bind(broken, symbol, cpu_packed_gemm.ARGTYPES)
    (rows, k), n = x.shape, w.shape[0]
    y = torch.zeros(rows, n)
    fn(x.data_ptr(), cpu_packed_gemm.pack(w).data_ptr(), None, y.data_ptr(), rows, n, k, threads)
    return y


def test_a_broken_packed_gemm_fails_the_reference_check():
    """Mutation check: the same source with the rows after the full register passes dropped
    gives results the fp64 check rejects."""
    x, w, _, expected, bound = _gemm_case(3, 5, 9, 37, False)
    old, new = "if (r == R) tile<W, R, PF>", "if (r == R + 1) tile<W, R, PF>"
    y = _broken_packed_gemm(old, new, "packed_gemm_f32", x, w, 1)
    assert not ((y.double() - expected).abs() <= bound).all()  # a NaN fails the check too


def test_a_broken_rows_first_order_fails_the_reference_check():
    """Mutation check of the rows-first order (many rows, a small weight): the same source
    with each full block's last tile skipped leaves outputs the fp64 check rejects."""
    x, w, _, expected, bound = _gemm_case(4, 120, 70, 37, False)
    old = "for (int64_t t = 0; t < tiles; ++t)\n        tile<W, MR, PF_OWN>"
    y = _broken_packed_gemm(old, old.replace("t < tiles", "t + 1 < tiles"), "packed_gemm_f32", x, w, 2)
    assert not ((y.double() - expected).abs() <= bound).all()


def test_a_broken_int8_group_scale_fails_the_reference_check():
    """Mutation check for int8 weights: every group of the first vector of outputs taking its
    first group's scale gives results the fp64 check rejects."""
    x, _, _, _, _ = _gemm_case(5, 3, 40, 100, False)
    q, scales, w = _int8_case(5, 40, 100)
    expected = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-5
    broken = _packed_gemm_mutant("s0 = load_scales(gs + k0 / GROUP * 2 * V);", "s0 = load_scales(gs);")
    fn = cpu_build.bind(broken, "packed_gemm_i8", cpu_packed_gemm.ARGTYPES_I8)
    y = torch.zeros(3, 40)
    packed, packed_scales = cpu_packed_gemm.pack(q), cpu_packed_gemm.pack_scales(scales)
    fn(x.data_ptr(), packed.data_ptr(), packed_scales.data_ptr(), None, y.data_ptr(), 3, 40, 100, 1)
    good = cpu_packed_gemm.gemm(x, packed, 40, None, packed_scales)
    assert ((good.double() - expected).abs() <= bound).all()
    assert not ((y.double() - expected).abs() <= bound).all()


def test_a_broken_bf16_widening_fails_the_reference_check():
    """Mutation check for bf16 weights: widening with the bits one place off (a shift of 15)
    gives results the fp64 check rejects."""
    x, w, _, _, _ = _gemm_case(4, 3, 40, 37, False)
    w = w.bfloat16()
    expected = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-5
    y = _broken_packed_gemm("), 16)));", "), 15)));", "packed_gemm_bf16", x, w, 1)  # the widening shift
    # garbage bits may widen to NaN, which fails the check as well (``max`` would hide it)
    assert not ((y.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_bf16_steps_of_few_rows_run_the_packed_kernel(rows):
    """A bf16 ``PackedLinear`` runs ``cpu_packed_gemm`` on its second copy up to
    ``BF16_PACKED_ROWS`` rows and oneDNN above (bitwise each kernel's own result), and the
    compiled op makes the same choice."""
    w = torch.randn(70, 48).bfloat16()
    x = torch.randn(rows, 48).bfloat16()
    if not PackedLinear.available(w):
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        pytest.skip("oneDNN has no bf16 kernels on this CPU (checked: available() says so)")
    layer = PackedLinear(w, None)
    assert layer.small is not None and layer.packed.is_mkldnn
    small = cpu_packed_gemm.gemm(x, layer.small, 70).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")
    assert torch.equal(layer(x), small if rows <= weight_only.BF16_PACKED_ROWS else onednn)
    assert torch.equal(cpu_linear(x, w, None), layer(x))
    torch.testing.assert_close(layer(x).float(), x.float() @ w.float().T, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows", [1, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_and_the_compiled_op_agree(rows, dtype):
    """PackedLinear and the ``cpu_linear`` op run the weight's packed copy (``cpu_packed_gemm``
    for fp32, oneDNN for bf16) and both compute ``x @ W.T + b``, bitwise alike."""
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 64, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    bf16_kernels = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert PackedLinear.available(w) == (dtype == torch.float32 or bf16_kernels)
    if not PackedLinear.available(w):
        pytest.skip("oneDNN has no bf16 kernels on this CPU (checked: available() says so)")
    packed = PackedLinear(w, b)
    assert packed.packed.is_mkldnn == (dtype == torch.bfloat16)
    expected = (x.float() @ w.float().T + b.float()).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(packed(x), expected, rtol=tol, atol=tol)
    assert torch.equal(cpu_linear(x, w, b), packed(x))


def test_cpu_linear_traces_as_one_op():
    """Under ``torch.compile`` the op keeps one graph for any row count (no guard on M)."""
    torch._dynamo.reset()
    w = torch.randn(16, 32)
    lin = PackedLinear(w, None)
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda x: lin(x) * 2, backend=counter, dynamic=True)
    for rows in (2, 5, 20):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(fn(x), (x @ w.T) * 2, rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1


def _attention_case(seed, heads, kv_heads, d, n, length, pool_rows, dtype):
    gen = torch.Generator().manual_seed(seed)
    t = n + 2
    q = torch.randn(t, heads, d, generator=gen).to(
        torch.float32 if is_fp8(dtype) or dtype == torch.int8 else dtype
    )
    k = _pool(torch.randn(pool_rows, kv_heads * d, generator=gen), dtype)
    v = _pool(torch.randn(pool_rows, kv_heads * d, generator=gen), dtype)
    rows = torch.randperm(t, generator=gen)[:n]
    rows[torch.rand(n, generator=gen) < 0.25] = -1  # padding rows
    kv = torch.randint(0, pool_rows, (n, length), generator=gen)
    valid = torch.rand(n, length, generator=gen) < 0.7
    spans, span_rows = torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return q, k, v, rows, kv, valid, spans, span_rows


@settings(max_examples=20, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 9),
    d=st.sampled_from([8, 16, 32, 33, 64, 128]),
    n=st.integers(1, 5),
    length=st.integers(1, 40),
    dtype=st.sampled_from(POOL_DTYPES),
    seed=st.integers(0, 10_000),
)
@example(kv_heads=2, group=3, d=64, n=4, length=30, dtype=torch.float8_e4m3fn, seed=1)
@example(kv_heads=1, group=2, d=33, n=3, length=17, dtype=torch.float8_e5m2, seed=2)
@example(kv_heads=3, group=3, d=64, n=4, length=33, dtype=torch.int8, seed=3)
def test_decode_attention_in_place_matches_the_gather_path(kv_heads, group, d, n, length, dtype, seed):
    """The in-place kernel equals the gather + SDPA reference (run on the same inputs with
    autograd on, which keeps the reference path), GQA, padding rows and masks included; fp8
    pools widened exactly, int8 rows scaled per block (fp32 queries: the fp32 tolerance)."""
    d = _int8_head(d, dtype)
    case = _attention_case(seed, kv_heads * group, kv_heads, d, n, length, 64, dtype)
    q = case[0]
    assert cpu_attention.supports(q, case[1], case[2])
    fast = paged_attention_reference(*case)
    ref = paged_attention_reference(
        q.float().requires_grad_(), *(kv_int8.read(c, torch.float32) for c in case[1:3]), *case[3:]
    )
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast.float(), ref.detach(), rtol=tol, atol=tol)


def _span_case(seed, heads, kv_heads, d, spans, dtype):
    """A step of prefill spans ``[(tokens, first position)]`` over shuffled pool rows."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(count for count, _ in spans) + 3
    pool_rows = sum(count + start for count, start in spans) + 5
    q = torch.randn(t, heads, d, generator=gen)
    k = _pool(torch.randn(pool_rows, kv_heads * d, generator=gen), dtype)
    v = _pool(torch.randn(pool_rows, kv_heads * d, generator=gen), dtype)
    order = torch.randperm(pool_rows, generator=gen)
    meta, rows, first, used = [], [], 1, 0
    for count, start in spans:
        end = count + start
        meta.append([first, count, start, used])
        rows.append(order[used : used + end])
        first, used = first + count, used + end
    none = torch.zeros(0, dtype=torch.long)
    decode = (none, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.bool))
    return (q, k, v, *decode, torch.tensor(meta, dtype=torch.long).view(-1, 4), torch.cat([none, *rows]))


@settings(max_examples=25, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 14),
    d=st.sampled_from([16, 32, 48, 64, 128]),
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 70)), min_size=1, max_size=4),
    dtype=st.sampled_from(POOL_DTYPES),
    seed=st.integers(0, 10_000),
)
@example(kv_heads=2, group=3, d=64, spans=[(20, 0), (7, 9)], dtype=torch.float8_e4m3fn, seed=3)
@example(kv_heads=1, group=4, d=32, spans=[(13, 40)], dtype=torch.float8_e5m2, seed=4)
@example(kv_heads=3, group=3, d=64, spans=[(9, 0), (12, 30)], dtype=torch.int8, seed=5)
def test_prefill_attention_in_place_matches_the_reference(kv_heads, group, d, spans, dtype, seed):
    """Prefill spans through ``cpu_prefill_attention`` (chunks starting past position 0,
    empty spans, GQA groups wider than a register tile, bf16/fp16 pools) equal the reference's
    per-span causal SDPA, run with autograd on, which keeps the reference path; head sizes the
    kernel does not take (48 on AVX-512) go to the reference."""
    d = _int8_head(d, dtype)
    case = _span_case(seed, kv_heads * group, kv_heads, d, spans, dtype)
    q = case[0]
    width = cpu_prefill_attention._width()
    assert cpu_prefill_attention.supports(q, case[1], case[2]) == (
        d % width == 0 and d // width in (1, 2, 4, 8)
    )
    fast = paged_attention_reference(*case)
    ref = paged_attention_reference(
        q.requires_grad_(), *(kv_int8.read(c, torch.float32) for c in case[1:3]), *case[3:]
    )
    torch.testing.assert_close(fast, ref.detach(), rtol=1e-5, atol=1e-5)


def test_a_broken_prefill_attention_fails_the_reference_check():
    """Mutation check: without the causal mask inside a row's last block of keys (later
    positions join the softmax) the comparison above fails."""
    source = cpu_build.source("prefill_attention.cpp").replace(
        "for (int64_t j = n; j < padded; ++j) p[j] = NINF;", ""
    )
    assert source != cpu_build.source("prefill_attention.cpp")
    broken = cpu_build.load(source)
    fn = cpu_build.bind(broken, "prefill_attention_f32", cpu_prefill_attention.ARGTYPES)
    q, k, v, _, _, _, spans, rows = _span_case(2, 6, 2, 64, [(20, 0), (7, 9)], torch.float32)
    out = torch.zeros(q.shape[0] + 1, 6, 64)
    fn(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        spans.data_ptr(),
        rows.data_ptr(),
        out.data_ptr(),
        2,
        6,
        2,
        64,
        0.125,
        1,
    )
    ref = paged_attention_reference(
        q.requires_grad_(), k, v, *_span_case(2, 6, 2, 64, [(20, 0), (7, 9)], torch.float32)[3:]
    )
    assert (out[: q.shape[0]] - ref.detach()).abs().max().item() > 1e-3


def test_a_broken_attention_kernel_fails_the_reference_check():
    """Mutation check: dropping the score pass's mask (masked keys join the softmax) is
    caught by the comparison above."""
    source = cpu_build.source("attention.cpp").replace(
        "    if (!ok[l]) {\n      for (int r = 0; r < GC; ++r) p[r * stride + l] = NINF;\n      continue;\n    }\n",
        "",
    )
    assert source != cpu_build.source("attention.cpp")
    broken = cpu_build.load(source)
    fn = cpu_build.bind(
        broken,
        "decode_attention_f32",
        [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int],
    )
    q, k, v, rows, kv, valid, spans, span_rows = _attention_case(1, 4, 2, 64, 3, 30, 64, torch.float32)
    rows = rows.abs()
    out = torch.zeros(q.shape[0] + 1, 4, 64)
    fn(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        rows.data_ptr(),
        kv.data_ptr(),
        valid.data_ptr(),
        out.data_ptr(),
        3,
        30,
        4,
        2,
        64,
        0.125,
        1,
    )
    ref = paged_attention_reference(q.requires_grad_(), k, v, rows, kv, valid, spans, span_rows)
    assert (out[: q.shape[0]] - ref.detach()).abs().max().item() > 1e-3


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 100),  # 64 and more: the tokens split over the threads
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half=st.integers(1, 20),
    act=st.sampled_from([torch.float32, torch.bfloat16]),
    pool=st.sampled_from(POOL_DTYPES),
    seed=st.integers(0, 10_000),
)
@example(tokens=70, kv_heads=2, group=2, half=16, act=torch.float32, pool=torch.float8_e4m3fn, seed=5)
@example(tokens=9, kv_heads=1, group=3, half=8, act=torch.bfloat16, pool=torch.float8_e5m2, seed=6)
@example(tokens=80, kv_heads=3, group=3, half=32, act=torch.bfloat16, pool=torch.int8, seed=7)
def test_rope_store_is_bitwise_the_reference(tokens, kv_heads, group, half, act, pool, seed):
    """Rotated q, and k and v in the pools, equal ``rotate_half_rope`` (then, for an int8 or
    fp8 pool, ``kv_rotation.rotate``) plus the two cache writes (``kv_dtypes.store``) bit for bit, for every activation/pool dtype pair, one thread
    or (from 64 tokens) several; fp8 pools saturate values past their range (a few scaled up
    to reach it)."""
    gen = torch.Generator().manual_seed(seed)
    if pool == torch.int8:  # rows of whole 32-value blocks
        half = -(-half // 16) * 16
    heads, d = kv_heads * group, 2 * half
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    qkv[torch.rand(qkv.shape, generator=gen) < 0.05] *= 1e5
    qkv = qkv.to(act)
    angles = torch.rand(tokens, half, generator=gen) * 100
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    rows = torch.randperm(120, generator=gen)[:tokens]
    width = kv_int8.row_width(kv_heads * d, pool)
    k_pool, v_pool = torch.zeros(120, width, dtype=pool), torch.zeros(120, width, dtype=pool)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q = cpu_rope_store.rope_store(qkv, cos, sin, rows, k_pool, v_pool, heads, kv_heads, d)
    qk = rotate_half_rope(qkv[:, : (heads + kv_heads) * d].reshape(tokens, -1, d), cos, sin)
    if kv_rotation.rotates(pool):  # an 8-bit cache's basis
        qk = kv_rotation.rotate(qk)
    kv_dtypes.store(k_ref, rows, qk[:, heads:].reshape(tokens, -1))
    kv_dtypes.store(v_ref, rows, qkv[:, (heads + kv_heads) * d :])
    assert torch.equal(q, qk[:, :heads].to(act))
    bits = torch.uint8 if is_fp8(pool) else pool  # ATen has no fp8 equal
    assert torch.equal(k_pool.view(bits), k_ref.view(bits)) and torch.equal(
        v_pool.view(bits), v_ref.view(bits)
    )


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 3 * cpu_norm_act.MAX_ROWS),  # above MAX_ROWS: split across threads
    d=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    residual=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_add_rms_norm_matches_the_module(rows, d, dtype, residual, seed):
    """``add_rms_norm`` equals ``x + delta`` followed by ``RMSNorm`` (the sum exactly, the norm
    to fp32 rounding, or one bf16 step)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, d, generator=gen).to(dtype) if residual else None
    norm = RMSNorm(d, 1e-5)
    norm.weight.data = torch.randn(d, generator=gen)
    res, out = cpu_norm_act.add_rms_norm(x, delta, norm.weight, norm.eps)
    expected_res = x + delta if residual else x
    assert torch.equal(res, expected_res)
    with torch.no_grad():
        expected = norm(expected_res)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 3 * cpu_norm_act.MAX_ROWS),  # above MAX_ROWS: split across threads
    inner=st.integers(1, 200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_silu_mul_matches_aten(rows, inner, dtype):
    gate_up = (torch.randn(rows, 2 * inner) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cpu_norm_act.silu_mul(gate_up), F.silu(gate) * up, rtol=tol, atol=tol)


def test_a_broken_norm_kernel_fails_the_module_check():
    """Mutation check: the mean of squares over d - 1 instead of d is caught."""
    source = cpu_build.source("norm_act.cpp").replace(
        "ss / static_cast<float>(d)", "ss / static_cast<float>(d - 1)"
    )
    assert source != cpu_build.source("norm_act.cpp")
    broken = cpu_build.load(source)
    fn = cpu_build.bind(
        broken, "add_rms_norm_f32", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    )
    x, w = torch.randn(2, 64), torch.randn(64)
    out = torch.empty_like(x)
    fn(x.data_ptr(), None, w.data_ptr(), x.data_ptr(), out.data_ptr(), 2, 64, 1e-5)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = w
    with torch.no_grad():
        assert (out - norm(x)).abs().max().item() > 1e-4


def _greedy(llm, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
        )
        for o in outs
    ]


@settings(max_examples=6, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([16, 32, 64]),
    layers=st.integers(1, 3),
    rows=st.integers(1, cpu_decode_stack.MAX_ROWS),
    kv_dtype=st.sampled_from(["float32", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8"]),
    quantization=st.sampled_from([None, "int8", "int4"]),
    seed=st.integers(0, 1000),
)
# int4 above the widening loop's 4 rows: the VNNI-packed weights, where the CPU has VNNI
@example(kv_heads=1, group=2, head_dim=32, layers=2, rows=9, kv_dtype="float32", quantization="int4", seed=9)
@example(
    kv_heads=2, group=1, head_dim=32, layers=1, rows=40, kv_dtype="bfloat16", quantization="int4", seed=4
)
# fp32 above 16 rows (the driver's packed copies; every row count runs them)
@example(kv_heads=3, group=3, head_dim=64, layers=2, rows=33, kv_dtype="float32", quantization=None, seed=5)
# two prompts: the whole prefill fits one stack call, so its prefill spans run in the stack
@example(kv_heads=2, group=2, head_dim=32, layers=2, rows=2, kv_dtype="float32", quantization=None, seed=3)
@example(kv_heads=1, group=3, head_dim=64, layers=1, rows=2, kv_dtype="float16", quantization="int8", seed=7)
@example(kv_heads=2, group=2, head_dim=32, layers=2, rows=5, kv_dtype="fp8", quantization=None, seed=8)
@example(kv_heads=1, group=2, head_dim=32, layers=1, rows=3, kv_dtype="fp8_e5m2", quantization="int4", seed=6)
@example(kv_heads=2, group=2, head_dim=64, layers=2, rows=6, kv_dtype="int8", quantization="int8", seed=2)
def test_one_call_decode_stack_equals_the_layer_loop(
    tmp_path_factory, kv_heads, group, head_dim, layers, rows, kv_dtype, quantization, seed
):
    """The C++ layer loop calls the same kernels in the same order: greedy tokens and their
    logprobs equal the per-layer path's bitwise, for any Llama shape, 1-64 decode rows, fp32,
    bf16, fp16 and fp8 pools, fp32, int8 or int4 weights (fp32: the packed kernel; int4: the VNNI
    kernel where the CPU has it; and the stack did run)."""
    if quantization == "int4" or kv_dtype == "int8":  # int4 groups, int8 cache blocks: 32 values
        head_dim = max(head_dim, 32)
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("stack"),
        "llama",
        seed=seed,
        num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=32 * kv_heads * group,
        num_hidden_layers=layers,
        intermediate_size=96,
    )
    # no prefix cache: the second run must compute exactly what the first did
    llm = LLM(
        str(path),
        max_num_seqs=cpu_decode_stack.MAX_ROWS,
        kv_cache_dtype=kv_dtype,
        enable_prefix_caching=False,
        quantization=quantization,
    )
    stack = llm.engine.runner.forward.stack
    assert stack is not None
    rows = min(rows, stack.max_rows)  # fp32 and int8: 64; int4: 64 with VNNI, else 4
    calls = {"n": 0, "spans": 0}
    real = type(stack).__call__

    def counted(self, *args):
        calls["n"] += 1
        calls["spans"] += bool(args[8][:, 1].any())  # a step with prefill spans ran here too
        return real(self, *args)

    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(2, 258, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(rows)
    ]
    type(stack).__call__ = counted
    try:
        fused = _greedy(llm, prompts)
    finally:
        type(stack).__call__ = real
    assert calls["n"] > 0
    # the whole prefill fits one stack call, and a prompt is long enough to attend as a span
    if sum(len(p) for p in prompts) <= stack.max_rows and max(map(len, prompts)) > 1:
        assert calls["spans"] > 0
    llm.engine.runner.forward.stack = None
    assert _greedy(llm, prompts) == fused


@pytest.mark.parametrize(
    "mutation",
    [
        ("h[i] = res[i] + down[i];", "h[i] = res[i];"),  # the last residual add skipped
        ("if (n_spans) span_attn(", "if (false) span_attn("),  # prefill spans left unattended
    ],
)
def test_a_broken_decode_stack_is_caught(tmp_path, mutation):
    """Mutation check for the test above: a stack that skips the last residual add, or the
    prefill spans' attention, gives other logprobs."""
    path = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    llm = LLM(str(path), max_num_seqs=8, enable_prefix_caching=False)
    prompts = [list(range(5, 21)), [9, 10]]  # two prefill spans
    fused = _greedy(llm, prompts)
    source = cpu_build.source("decode_stack.cpp").replace(*mutation)
    assert source != cpu_build.source("decode_stack.cpp")
    broken = cpu_build.load(source)
    cpu_build.bind(broken, "llama_decode_stack", cpu_decode_stack._ARGS)
    real = cpu_decode_stack.library
    cpu_decode_stack.library = lambda: broken
    try:
        assert _greedy(llm, prompts) != fused
    finally:
        cpu_decode_stack.library = real
    assert _greedy(llm, prompts) == fused
