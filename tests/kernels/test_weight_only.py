"""Weight-only int8/int4 for dense models on CPU (``LLM(..., quantization=...)``): the kernels
compute with exactly the quantized weights they report, the quantization error is what the
format allows, the engine runs the quantized projections, and bad options are clear errors.
Speed and greedy agreement on SmolLM2 are measured in benchmarks/cpu_decode.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepinfer.kernels.cpu import gemv as cpu_gemv
from deepinfer.kernels.cpu import int4_vnni as cpu_int4_vnni
from deepinfer.kernels.weight_only import INT4_GROUP, QUANTIZED_SMALL_ROWS, WeightOnlyLinear
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import needs_compiler, require

from deepinfer import LLM, SamplingParams, load_model
from deepinfer.models.layers.projection import Projection
from deepinfer.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels' threaded paths, at any -n

# inputs per scale in the formats (Q8_0's blocks for int8, int4's groups): the tests' own
# constant, so a module that quantized per row or in coarser groups fails them
FORMAT_GROUP = 32


@settings(max_examples=12, deadline=None)
@given(
    method=st.sampled_from(["int8", "int4", "bf16"]),
    out_features=st.integers(1, 70),
    groups=st.integers(1, 6),
    rows=st.integers(1, 40),
    bias=st.booleans(),
    ragged=st.integers(0, 31),
    seed=st.integers(0, 10_000),
)
def test_kernels_compute_with_the_weights_they_report(method, out_features, groups, rows, bias, ragged, seed):
    """The weights the module reports (``dequantize()``) are the format's definition computed
    in the test (``_quantized``: int8 symmetric and int4 asymmetric per 32-input group, fp16
    scales; bf16 rounded to nearest even), each within half its group's step of the original;
    and the kernel's output equals the activations times those weights: int8 in fp32 at every
    size (``cpu_packed_gemm``, or the dequantized weight where it did not build; widths off its
    32-input groups too), int4 in fp32 at decode sizes (``cpu_gemv``'s widening loop) and
    PyTorch's fp32 int4 kernel above, or on AVX-512 VNNI or AVX2 the activations rounded to int8
    per group at every size."""
    gen = torch.Generator().manual_seed(seed)
    in_features = groups * INT4_GROUP * 2 - (ragged if method != "int4" else 0)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    lin = WeightOnlyLinear(w, b, method)
    deq, defined = lin.dequantize(), _quantized(w, method)
    assert ((deq - w).abs() <= _format_error_bound(w, method)).all()  # half a step of its group
    assert torch.equal(deq, defined)
    got = lin(x)
    assert got.dtype == x.dtype and got.shape == (rows, out_features)
    if method == "int4" and lin.packed_vnni is not None:  # every size: int8 activations
        exact = _int8_per_group(x) @ defined.T + (b if b is not None else 0)
    else:  # fp32 throughout
        exact = x @ defined.T + (b if b is not None else 0)
    assert (got - exact).norm() <= 1e-5 * exact.norm()
    # plus at most one packed tile of zero rows (32 on AVX-512) past out_features
    per_weight = {"int8": 1.1, "int4": 0.7, "bf16": 2.0}[method]
    assert lin.nbytes <= w.numel() * per_weight + 32 * in_features * (2 if method == "bf16" else 1)


def test_a_broken_scale_fails_the_kernel_check():
    """Mutation check of the test above: scales off by 5% are caught, on int8's paths (the
    packed kernel at every size, or the dequantized weight where it did not build) and
    int4's."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=gen)
    for rows in (QUANTIZED_SMALL_ROWS, QUANTIZED_SMALL_ROWS + 8):
        x = torch.randn(rows, 64, generator=gen)
        lin = WeightOnlyLinear(w, None, "int8")
        expected = x @ lin.dequantize().T
        lin.scales = lin.scales * 1.05
        if lin.packed_scales is not None:
            lin.packed_scales = (lin.packed_scales.float() * 1.05).half()
        assert (lin(x) - expected).norm() > 2e-2 * expected.norm()
    lin = WeightOnlyLinear(torch.randn(16, 64, generator=gen), None, "int4")  # int4's loop too
    x = torch.randn(QUANTIZED_SMALL_ROWS, 64, generator=gen)
    expected = x @ lin.dequantize().T
    good = cpu_gemv.small_gemm_int4(x, lin.packed4, lin.scale4, lin.offset4)
    assert (good - expected).norm() <= 1e-5 * expected.norm()
    wrong = cpu_gemv.small_gemm_int4(x, lin.packed4, lin.scale4 * 1.05, lin.offset4 * 1.05)
    assert (wrong - expected).norm() > 2e-2 * expected.norm()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wo_llama"), arch="llama", seed=7)


def _format_error_bound(weight: torch.Tensor, method: str) -> torch.Tensor:
    """Per weight, the most the format may move it: half of its group's step (int8: max |w| /
    127, int4: (max - min) / 15, per ``FORMAT_GROUP`` inputs), plus what fp16 scales and zeros
    add (a relative 2^-11 of each, times codes up to 127 or 8); bf16: half an ulp, 2^-8 of |w|."""
    w = weight.detach().float()
    if method == "bf16":
        return w.abs() * 2**-8
    cols = w.shape[1]
    groups = torch.nn.functional.pad(w, (0, -cols % FORMAT_GROUP)).reshape(w.shape[0], -1, FORMAT_GROUP)
    absmax = groups.abs().amax(-1, keepdim=True)
    if method == "int8":
        step = absmax / 127
    else:
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    bound = step * (0.5 + 2**-7) + absmax * 2**-9 + 1e-30
    return bound.expand_as(groups).reshape(w.shape[0], -1)[:, :cols]


def _quantized(weight: torch.Tensor, method: str, broken: bool = False) -> torch.Tensor:
    """``weight`` as the quantization defines it, dequantized in plain torch: bf16 rounded to
    nearest even; int8 symmetric
    per group of 32 inputs of a row (scale = max |w| / 127 kept in fp16, codes round(w / scale));
    int4 asymmetric per group of 32 inputs (scale = (max - min) / 15, codes q = round((w - min)
    / scale) in 0..15, value (q - 8) * scale + zero with zero = min + 8 * scale, scale and zero
    kept in fp16). ``broken``, the mutation: bf16 rounded as fp16 instead, int8 with one scale
    per row, int4 with bf16 scales and zeros."""
    w = weight.detach().float()
    if method == "bf16":
        return w.half().float() if broken else w.bfloat16().float()
    if method == "int8":
        cols = w.shape[1]
        blocks = w.shape[1] if broken else FORMAT_GROUP
        groups = torch.nn.functional.pad(w, (0, -cols % blocks)).reshape(w.shape[0], -1, blocks)
        scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        q = torch.where(scale > 0, groups / scale, 0.0).round().clamp(-127, 127)
        return (q * scale).reshape(w.shape[0], -1)[:, :cols]
    scale_dtype = torch.bfloat16 if broken else torch.float16
    groups = w.reshape(w.shape[0], -1, FORMAT_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-12) / 15
    q = ((groups - low) / scale).round().clamp(0, 15)
    zero = low + 8 * scale
    return ((q - 8) * scale.to(scale_dtype).float() + zero.to(scale_dtype).float()).reshape(w.shape)


def _load_quantized(twin, method: str, broken: bool = False) -> None:
    """Quantize every projection of ``twin`` (and its head, untied from the embedding as the
    engine unties it) by ``_quantized``."""
    for layer in twin.model.layers:
        for lin in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            lin.weight.copy_(_quantized(lin.weight, method, broken))
    head = twin.lm_head.weight if not twin.config.tie_word_embeddings else twin.model.embed_tokens.weight
    if twin.config.tie_word_embeddings:  # the engine quantizes the head, not the embedding
        twin.config.tie_word_embeddings = False
        twin.lm_head = torch.nn.Linear(twin.config.hidden_size, twin.config.vocab_size, bias=False)
        twin.head = Projection(twin.lm_head)
    # the head keeps 8 bits under int4 (as llama.cpp keeps its output tensor above 4)
    if method == "int4":
        twin.lm_head.weight.copy_(_quantized(head, "int8"))
    else:
        twin.lm_head.weight.copy_(_quantized(head, method, broken))


def _int8_per_group(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as ``cpu_int4_vnni`` rounds activations: int8 per group of 32."""
    groups = x.reshape(*x.shape[:-1], -1, INT4_GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((groups * inv).round() * scale).reshape(x.shape)


def _kernel_rounding(model) -> list:
    """Round every projection's input but the int8 head's to int8 per group of 32, as int4 on
    AVX-512 VNNI or AVX2 does (outputs stay fp32)."""

    def round_input(_module, args):
        return (_int8_per_group(args[0]), *args[1:])

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    return [m.register_forward_pre_hook(round_input) for m in linears]


def _reference_logprobs(path, method: str, prompt: list[int], broken: bool = False) -> torch.Tensor:
    """Log-softmax rows of a plain fp32 model whose weights are quantized by ``_quantized``
    and whose projections round their inputs as the kernels do (``_kernel_rounding``)."""
    twin = load_model(path)
    vnni = method == "int4" and cpu_int4_vnni.available()
    with torch.no_grad():
        _load_quantized(twin, method, broken)
        handles = _kernel_rounding(twin) if vnni else []
        logits = twin(torch.tensor([prompt])).logits[0]
        for handle in handles:
            handle.remove()
    return logits.log_softmax(-1)


def _worst(out, ref: torch.Tensor) -> float:
    """The largest difference between the engine's prompt logprobs and ``ref``'s rows."""
    worst = 0.0
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):  # entry i: logits at i - 1
        tokens = sorted(entry)
        got = torch.tensor([entry[t].logprob for t in tokens])
        worst = max(worst, (got - ref[i - 1, tokens]).abs().max().item())
    return worst


@pytest.mark.parametrize("method", ["int8", "int4", "bf16"])
def test_engine_runs_the_quantized_projections(llama_path, method):
    """The engine's prompt logprobs equal those of a plain fp32 model whose weights are
    quantized in the test from the format's definition (``_quantized``) and whose
    projections' inputs are rounded as the kernels round them (none for int8, which computes
    in fp32, as does bf16; int8 activations per group for int4 on AVX-512 VNNI or AVX2), within
    1e-4. Mutation check: the reference with int8's scales one per row, int4's scales and zeros
    in bf16, or bf16 weights rounded as fp16, is caught; and quantization did change the weights."""
    prompt = [5, 9, 33, 70, 12, 8, 200, 41, 3, 19]
    quantized = LLM(llama_path, quantization=method)
    out = quantized.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    ref = _reference_logprobs(llama_path, method, prompt)
    assert _worst(out, ref) <= 1e-4, _worst(out, ref)
    assert _worst(out, _reference_logprobs(llama_path, method, prompt, broken=True)) > 1e-4
    with torch.no_grad():
        unquantized = load_model(llama_path)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert (ref - unquantized).abs().max().item() > 1e-3  # quantization changed the weights


def test_quantization_options_are_checked(llama_path, v4_ckpt):
    with pytest.raises(ValueError, match="quantization"):
        LLM(llama_path, quantization="int3")
    with pytest.raises(ValueError, match="CPU only"):
        LLM(llama_path, quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="not supported for DeepseekV4ForCausalLM"):
        LLM(v4_ckpt, quantization="int8")


def test_int8_widths_off_its_groups():
    """in_features not a multiple of the 32-input groups: the last group is shorter, the kernel
    computes with the weights it reports at every row count, and they are within the format's
    error of the originals."""
    gen = torch.Generator().manual_seed(1)
    for k in (8, 24, 72, 100):
        w = torch.randn(20, k, generator=gen)
        lin = WeightOnlyLinear(w, None, "int8")
        x = torch.randn(QUANTIZED_SMALL_ROWS + 7, k, generator=gen)
        exact = x @ lin.dequantize().T
        assert (lin(x) - exact).norm() <= 1e-5 * exact.norm()
        assert torch.equal(lin.dequantize(), _quantized(w, "int8"))


def _cpu_runs_int4_vnni() -> bool:
    """From the CPU's flags, not from whether the kernel built: AVX-512 VNNI (with F, BW and
    DQ) or AVX2 with FMA and F16C, what ``int4_vnni.cpp`` asks the CPU for (PyTorch's CPU
    capability where ``/proc/cpuinfo`` is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())
    return {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"} <= flags or {"avx2", "fma", "f16c"} <= flags


@pytest.fixture(scope="module")
def vnni_built() -> None:
    """On a CPU that runs it, the kernel must have built: a compile error fails, not skips."""
    require(cpu_int4_vnni.available(), "the int4 VNNI kernel")


def needs_vnni(test: Callable) -> Callable:
    """Skip where the CPU lacks the instructions or no compiler exists; else the kernel must
    have built (``vnni_built``)."""
    no_isa = pytest.mark.skipif(
        not _cpu_runs_int4_vnni(), reason="this CPU has neither AVX-512 VNNI nor AVX2"
    )
    return no_isa(needs_compiler(pytest.mark.usefixtures("vnni_built")(test)))


@needs_vnni
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    groups=st.integers(1, 40),
    m=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_vnni_int4_kernel_equals_its_definition(n, groups, m, seed):
    """``cpu_int4_vnni.gemm`` is ``x_q @ ((q - 8) * s + z).T`` with ``x_q`` the activations rounded
    to int8 per group, for any width (whole tiles of 16 groups and partial ones), row counts
    and weight rows; a row's result is the same bits alone or in any batch."""
    gen = torch.Generator().manual_seed(seed)
    k = groups * INT4_GROUP
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.1).half().float()  # stored as fp16
    zero = (torch.randn(n, groups, generator=gen) * 0.1).half().float()
    x = torch.randn(m, k, generator=gen) * 3
    if m > 1:
        x[0, :INT4_GROUP] = 0  # an all-zero group (scale 0)
    per_element = (
        scale.double().repeat_interleave(INT4_GROUP, 1),
        zero.double().repeat_interleave(INT4_GROUP, 1),
    )
    w = (q.double() - 8) * per_element[0] + per_element[1]
    want = _int8_per_group(x).double() @ w.T
    packed = cpu_int4_vnni.pack(q, scale, zero)
    got = cpu_int4_vnni.gemm(x, packed, n)
    assert (got.double() - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    row = m // 2
    alone = cpu_int4_vnni.gemm(x[row : row + 1], packed, n)
    assert torch.equal(alone[0], got[row])
    # AVX2 and VNNI give the same bits (a comparison only a VNNI CPU, which runs both, makes)
    for path in cpu_int4_vnni.isas():
        assert torch.equal(cpu_int4_vnni.gemm(x, packed, n, path=path), got)
    # mutation check: the bound above catches a 5% scale error wherever that error moves the
    # exact result past the bound (one output of one group can sit near zero: seed 418,
    # n = groups = m = 1 moved it by 1.7e-5 against a bound of 3.3e-5)
    wrong = cpu_int4_vnni.gemm(x, cpu_int4_vnni.pack(q, scale * 1.05, zero), n)
    bound = 1e-5 * (1 + want.abs().max())
    shift = (_int8_per_group(x).double() @ (0.05 * (q.double() - 8) * per_element[0]).T).abs().max()
    if shift > 2 * bound:
        assert (wrong.double() - want).abs().max() > bound


@needs_vnni
def test_int4_runs_the_vnni_kernel_at_every_row_count():
    """Decode sizes included (so a row's int4 result does not depend on the batch size)."""
    gen = torch.Generator().manual_seed(5)
    lin = WeightOnlyLinear(torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen), "int4")
    assert lin.packed_vnni is not None
    x = torch.randn(QUANTIZED_SMALL_ROWS + 5, 96, generator=gen)
    want = _int8_per_group(x) @ lin.dequantize().T + lin.bias
    got = lin(x)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    for rows in (1, QUANTIZED_SMALL_ROWS):
        assert torch.equal(lin(x[:rows]), got[:rows])
