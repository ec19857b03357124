"""fp8-block linears and fp4 routed experts stay in their stored formats in memory: the ops
equal dequantize-then-matmul on generated shapes, tiny V4 / V4.1 release-format checkpoints
keep resident weights near the size of their files with the logits of the dequantize-on-load
path, and ``quantization="fp8"`` quantizes float linears on load."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from deepinfer.kernels import quantized
from deepinfer.kernels.moe import routed_experts_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.memory import weight_bytes
from deepinfer.models.layers.quantized_linear import Fp8BlockLinear
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.quant import dequantize_fp4, dequantize_fp8_blocks, quantize_fp4, quantize_fp8_blocks


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 9),
    n=st.integers(1, 700),  # past TILE_ROWS: several tiles, a ragged last one
    k=st.integers(1, 300),
    block_n=st.sampled_from([1, 32, 128]),
    block_k=st.sampled_from([32, 128]),
    seed=st.integers(0, 10_000),
)
def test_fp8_block_linear_equals_dequantize_then_matmul(m, n, k, block_n, block_k, seed):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen), (block_n, block_k))
    x = torch.randn(m, k, generator=gen)
    expected = F.linear(x, dequantize_fp8_blocks(q, scale, (block_n, block_k)))
    got = quantized.fp8_block_linear(x, q, scale, block_n, block_k)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_misaligned_scale_tile_fails_the_check():
    """Mutation check for the test above: reading each tile's scales one block late is caught."""
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize_fp8_blocks(torch.randn(600, 64, generator=gen) * torch.rand(600, 1) * 10, (32, 32))
    x = torch.randn(3, 64, generator=gen)
    expected = F.linear(x, dequantize_fp8_blocks(q, scale, (32, 32)))
    shifted = torch.cat([scale[1:], scale[-1:]])
    assert not torch.allclose(
        quantized.fp8_block_linear(x, q, shifted, 32, 32), expected, rtol=1e-5, atol=1e-5
    )


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 12),
    experts=st.integers(1, 6),
    k=st.integers(1, 3),
    hidden=st.sampled_from([32, 64]),
    inter=st.sampled_from([32, 96]),
    seed=st.integers(0, 10_000),
)
def test_fp4_routed_experts_equal_the_reference_on_dequantized_weights(
    tokens, experts, k, hidden, inter, seed
):
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    packed = {}
    for name, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
        pairs = [quantize_fp4(torch.randn(*shape, generator=gen)) for _ in range(experts)]
        packed[name] = (
            torch.stack([p for p, _ in pairs]).view(torch.uint8),
            torch.stack([s for _, s in pairs]),
        )
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    dense = {n: [dequantize_fp4(p[e], s[e]) for e in range(experts)] for n, (p, s) in packed.items()}
    expected = routed_experts_reference(x, weights, ids, dense["w1"], dense["w2"], dense["w3"], 7.0)
    (w1, s1), (w2, s2), (w3, s3) = packed["w1"], packed["w2"], packed["w3"]
    got = quantized.routed_experts_fp4(x, weights, ids, w1, s1, w2, s2, w3, s3, 7.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fp4_experts_with_swapped_nibbles_fail_the_check():
    """Mutation check for the test above: reading the high nibble first is caught."""
    gen = torch.Generator().manual_seed(1)
    pairs = {
        n: [quantize_fp4(torch.randn(32, 32, generator=gen)) for _ in range(2)] for n in ("w1", "w2", "w3")
    }
    packed = {
        n: (torch.stack([p for p, _ in v]).view(torch.uint8), torch.stack([s for _, s in v]))
        for n, v in pairs.items()
    }
    x, ids, weights = torch.randn(4, 32, generator=gen), torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)
    dense = {n: [dequantize_fp4(p[e], s[e]) for e in range(2)] for n, (p, s) in packed.items()}
    expected = routed_experts_reference(x, weights, ids, dense["w1"], dense["w2"], dense["w3"], 7.0)
    swapped = {n: ((p >> 4) | (p << 4), s) for n, (p, s) in packed.items()}
    (w1, s1), (w2, s2), (w3, s3) = swapped["w1"], swapped["w2"], swapped["w3"]
    got = quantized.routed_experts_fp4(x, weights, ids, w1, s1, w2, s2, w3, s3, 7.0)
    assert not torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def release_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch=request.param, seed=5, quant="fp8"
    )


def _file_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def test_release_format_stays_resident_near_the_file_size(release_ckpt):
    """In bf16 (the release's compute dtype) resident weights are at most 1.15x the files;
    dequantizing on load (the old behaviour) takes far more."""
    files = _file_bytes(release_ckpt)
    kept = load_model(release_ckpt, dtype=torch.bfloat16, keep_quantized=True)
    assert any(isinstance(m, Fp8BlockLinear) for m in kept.modules())
    assert any(getattr(m, "holds_fp4", False) for m in kept.modules())
    assert sum(weight_bytes(kept).values()) <= 1.15 * files
    dequantized = load_model(release_ckpt, dtype=torch.bfloat16)
    assert sum(weight_bytes(dequantized).values()) >= 1.5 * files
    # (V4.1's Engram tables stay fp8 either way)
    assert weight_bytes(kept)["float8_e4m3fn"] > 10 * weight_bytes(dequantized).get("float8_e4m3fn", 0)


def test_resident_logits_equal_the_dequantize_on_load_path(release_ckpt):
    ids = torch.randint(0, 258, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kept = load_model(release_ckpt, keep_quantized=True)(ids).logits
        dequantized = load_model(release_ckpt)(ids).logits
    assert (kept - dequantized).abs().max() <= 1e-5


def test_engine_default_keeps_the_release_format_and_matches_none(release_ckpt):
    """``LLM`` keeps the stored formats by default; ``quantization="none"`` dequantizes; the
    greedy tokens and their logprobs agree (fp32)."""
    prompts = [[5, 9, 23, 7], [100, 3], list(range(40, 75))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for quantization in (None, "none"):
        llm = LLM(str(release_ckpt), quantization=quantization, enable_prefix_caching=False)
        resident = any(isinstance(m, Fp8BlockLinear) for m in llm.model.modules())
        assert resident == (quantization is None)
        outs[quantization] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs[None], outs["none"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for t, la, lb in zip(
            a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True
        ):
            assert math.isclose(la[t].logprob, lb[t].logprob, abs_tol=1e-4)


def test_fp8_quantization_on_load_of_a_float_checkpoint(v4_ckpt):
    """``quantization="fp8"``: the release format's linears become resident fp8 blocks, the
    weights shrink, and the logits are those of the float model holding the dequantized
    blocks."""
    twin = LLM(str(v4_ckpt), quantization="none").model
    fp8 = LLM(str(v4_ckpt), quantization="fp8").model
    names = [n for n, m in fp8.named_modules() if isinstance(m, Fp8BlockLinear)]
    assert any(n.endswith("attn.wq_a") for n in names) and any("shared_experts" in n for n in names)
    assert not any("compressor" in n or n.endswith("wo_a") for n in names)
    assert sum(weight_bytes(fp8).values()) < sum(weight_bytes(twin).values())
    ids = torch.randint(0, 258, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = twin(ids).logits
        for name in names:
            block = fp8.get_submodule(name)
            twin.get_submodule(name).weight.copy_(
                dequantize_fp8_blocks(block.weight, block.scale, block.block)
            )
        after = twin(ids).logits
        got = fp8(ids).logits
    assert (got - after).abs().max() <= 1e-5
    assert (got - before).abs().max() > 1e-4  # the weights were quantized


def test_fp8_quantization_is_refused_for_dense_models(tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' is not supported"):
        LLM(str(make_tiny_checkpoint(tmp_path, "llama")), quantization="fp8")


def test_the_triton_kernels_match_the_references_under_the_interpreter():
    """The CUDA kernels, run by Triton's interpreter on CPU tensors: the fp8 linear with fp32
    and bf16 activations, blocks of 1 / 32 / 128 rows, ragged tiles (a scale table read one
    block late fails); the fp4 routed experts."""
    code = """
import torch
from deepinfer.kernels.quantized import fp8_block_linear
from deepinfer.kernels.quantized_triton import fp8_block_linear_triton
from deepinfer.weights.quant import quantize_fp8_blocks
g = torch.Generator().manual_seed(0)
for m, n, k, bn, bk in ((1, 70, 96, 32, 32), (37, 300, 200, 128, 128), (5, 64, 64, 1, 32)):
    q, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 8, (bn, bk))
    for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        x = torch.randn(m, k, generator=g).to(dt)
        ref = fp8_block_linear(x, q, s, bn, bk).float()
        got = fp8_block_linear_triton(x, q, s, bn, bk)
        assert got.dtype == dt and got.shape == ref.shape
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= tol, (m, n, k, dt, err)
        late = torch.cat([s[1:], s[-1:]])
        bad = ((fp8_block_linear_triton(x, q, late, bn, bk).float() - ref).abs().max() / ref.abs().max()).item()
        assert bad > 10 * tol or n <= bn, (m, n, k, dt, bad)
from deepinfer.kernels.quantized import routed_experts_fp4, routed_experts_fp4_triton
from deepinfer.weights.quant import quantize_fp4
experts, hidden, inter = 3, 64, 96
packed = {}
for name, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
    pairs = [quantize_fp4(torch.randn(*shape, generator=g)) for _ in range(experts)]
    packed[name] = (torch.stack([p for p, _ in pairs]).view(torch.uint8), torch.stack([s for _, s in pairs]))
x = torch.randn(9, hidden, generator=g)
ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(9)])
weights = torch.rand(9, 2, generator=g)
args = (x, weights, ids, *packed["w1"], *packed["w2"], *packed["w3"], 7.0)
ref, got = routed_experts_fp4(*args), routed_experts_fp4_triton(*args)
assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
