"""The KV cache in the precision the model was trained for: each format's decode of its
encode is bitwise the QAT fake-quant of the same values, and an engine storing V4.1's (or V4
with fake-quant's) cache packed gives the logprobs of the fake-quant forward with the fp32
cache while each token costs the bytes the formats say."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.cache import kv_formats
from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.cache.kv_formats import PackedRows
from deepinfer.models.layers.fake_quant import (
    fake_quant_fp4_e4m3_scale,
    fake_quant_fp4_pow2,
    fake_quant_fp8_pow2,
)
from deepinfer.tiny import make_tiny_checkpoint

FAKE_QUANT = {
    "fp8_pow2_32": fake_quant_fp8_pow2,
    "fp4_e4m3_16": fake_quant_fp4_e4m3_scale,
    "fp4_pow2_32": fake_quant_fp4_pow2,
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FAKE_QUANT)),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    log_magnitude=st.floats(-12, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 10_000),
)
def test_decode_of_encode_is_the_fake_quant_bitwise(fmt, rows, blocks, log_magnitude, dtype, seed):
    dim = blocks * kv_formats.FORMATS[fmt][0]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(rows, dim, generator=gen) * 2.0**log_magnitude * torch.rand(rows, 1, generator=gen)
    raw[0, : dim // 3] = -0.0  # signed zeros and a zero block survive too
    raw = raw.to(dtype)
    data = kv_formats.encode(fmt, raw)
    assert data.dtype == torch.uint8 and data.shape == (rows, kv_formats.row_bytes(fmt, dim))
    assert torch.equal(_bits(kv_formats.decode(fmt, data, dim, dtype)), _bits(FAKE_QUANT[fmt](raw)))


def test_a_decoder_reading_nibbles_the_other_way_fails_the_check():
    """Mutation check for the test above."""
    raw = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    data = kv_formats.encode("fp4_e4m3_16", raw)
    codes, scales = data[:, :32], data[:, 32:]
    swapped = torch.cat([(codes >> 4) | (codes << 4), scales], dim=1)
    assert not torch.equal(
        kv_formats.decode("fp4_e4m3_16", swapped, 64, torch.float32), fake_quant_fp4_e4m3_scale(raw)
    )


@pytest.mark.parametrize("arch, fake_quant", [("deepseek_v41", None), ("deepseek_v4", True)])
def test_packed_cache_gives_the_fake_quant_forward_in_fewer_bytes(tmp_path, arch, fake_quant):
    """``kv_cache_dtype="auto"`` (the default) packs the cache; ``"float32"`` keeps the fp32
    rows of the same fake-quant forward. Prompt and sampled logprobs agree within 1e-5 (they
    are the same values), and the bytes per token shrink by what the formats predict."""
    path = make_tiny_checkpoint(tmp_path, arch=arch, seed=4)
    prompts = [list(range(3, 70)), [9, 8, 7], list(range(100, 220))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    runs = {}
    for kv in ("auto", "float32"):
        llm = LLM(str(path), kv_cache_dtype=kv, fake_quant=fake_quant, max_num_batched_tokens=48)
        runs[kv] = (llm, llm.generate(prompts, params, use_tqdm=False))
    packed, plain = runs["auto"][0], runs["float32"][0]
    assert all(isinstance(p.window, PackedRows) for p in packed.engine.runner.pools)
    assert not any(isinstance(p.window, PackedRows) for p in plain.engine.runner.pools)
    # what a compiled step marks static: every pool tensor (a packed pool's bytes) once, the
    # aliases of V4.1's shared entries included
    tensors = list(ForwardBatch.pool_tensors(SimpleNamespace(pools=packed.engine.runner.pools)))
    assert len({id(t) for t in tensors}) == len(tensors)
    assert all(any(p.window.data is t for t in tensors) for p in packed.engine.runner.pools)
    for a, b in zip(runs["auto"][1], runs["float32"][1], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(
            a.outputs[0].logprobs + a.prompt_logprobs[1:],
            b.outputs[0].logprobs + b.prompt_logprobs[1:],
            strict=True,
        ):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for t in x)
    # the expected bytes: fp8 window rows (D + D/32), fp4 entries (D/2 + D/16) and index keys
    # (d/2 + d/32) per row against 4 bytes a value, as the layers' specs say
    layout = packed.engine.layout
    expected_window = sum(kv_formats.row_bytes("fp8_pow2_32", s.kv_dim) for s in layout.specs)
    assert layout.window_block_bytes(torch.float32) == layout.block_size * (
        expected_window + 8 * sum(s.token_ids for s in layout.specs)
    )
    plain_window = plain.engine.layout.window_block_bytes(torch.float32)
    assert plain_window > 3.5 * layout.window_block_bytes(torch.float32)
    assert (
        packed.memory_report()["kv_cache"]["bytes_per_token"]
        < 0.5 * plain.memory_report()["kv_cache"]["bytes_per_token"]
    )


@pytest.mark.parametrize("fmt", sorted(kv_formats.FORMATS))
def test_a_packed_pool_knows_its_width_from_its_bytes(fmt):
    """``PackedRows.dim`` comes from the row's bytes (a constant in a compiled step, where the
    pool's width is static); a width the format's blocks do not divide is a clear error."""
    block = kv_formats.FORMATS[fmt][0]
    for dim in (block, 2 * block, 7 * block, 512):
        pool = kv_formats.packed_zeros(fmt, 3, dim, torch.float32, "cpu", torch.zeros)
        assert pool.dim == dim and pool.shape == (3, dim)
    with pytest.raises(ValueError, match=fmt):
        kv_formats.packed_zeros(fmt, 3, block + 1, torch.float32, "cpu", torch.zeros)
