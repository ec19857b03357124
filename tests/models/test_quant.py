"""fp8 e4m3 block-scaled and fp4 e2m1 weight storage: formats, round trips, loading."""

from __future__ import annotations

import torch

from deepinfer import load_model
from deepinfer.tiny import random_state_dict, tiny_config
from deepinfer.weights.quant import dequantize_fp4, dequantize_fp8_blocks, quantize_fp4, quantize_fp8_blocks
from deepinfer.weights.writer import write_safetensors


def test_fp4_decoding_follows_the_e2m1_code_table():
    # byte 0x71: low nibble 1 -> +0.5 (even element), high nibble 7 -> +6.0
    # byte 0xA9: low nibble 9 -> -0.5, high nibble 10 -> -1.0
    packed = torch.tensor([[0x71, 0xA9] + [0] * 14], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e8m0fnu)
    values = dequantize_fp4(packed, scale)
    assert values[0, :4].tolist() == [1.0, 12.0, -1.0, -2.0]
    assert values[0, 4:].abs().sum() == 0


def test_fp4_round_trip_is_exact_on_representable_values():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = (grid[torch.randint(0, 8, (4, 64))] * torch.where(torch.rand(4, 64) < 0.5, -1.0, 1.0)) * 0.25
    w[:, ::32] = 6.0 * 0.25  # each 32-block's max pins the scale to 0.25
    q, s = quantize_fp4(w)
    assert q.shape == (4, 32) and s.shape == (4, 2) and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(dequantize_fp4(q, s), w)


def test_fp8_block_scales_are_powers_of_two_and_error_is_bounded():
    w = torch.randn(70, 90)
    q, s = quantize_fp8_blocks(w, (32, 32))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    sf = s.float()
    assert torch.equal(sf, torch.exp2(torch.log2(sf).round()))
    back = dequantize_fp8_blocks(q, s, (32, 32))
    assert (back - w).abs().max() <= w.abs().max() * 2**-3  # e4m3 keeps 3 mantissa bits


def test_fp8_checkpoint_matches_its_dequantized_twin(v4_fp8_ckpt, tmp_path, hf_reference):
    """Load the fp8/fp4 checkpoint; independently dequantize its files; store that in fp32;
    both load to the same logits, and transformers agrees on the fp32 twin."""
    import json

    from safetensors.torch import load_file

    raw = load_file(str(v4_fp8_ckpt / "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in raw.values())
    assert any(t.dtype == torch.int8 and ".experts." in n for n, t in raw.items())
    twin: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name[: -len("weight")] + "scale")
        if t.dtype == torch.float8_e4m3fn:  # 32x32 blocks: repeat each scale over its block
            full = scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
            twin[name] = t.float() * full[: t.shape[0], : t.shape[1]]
        elif t.dtype == torch.int8:
            twin[name] = dequantize_fp4(t, scale)
        else:
            twin[name] = t.float() if t.is_floating_point() else t
    config = json.loads((v4_fp8_ckpt / "config.json").read_text())
    config.pop("quantization_config")
    config.pop("expert_dtype")
    write_safetensors(twin, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))

    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantized = load_model(v4_fp8_ckpt)(ids).logits
        dequantized = load_model(tmp_path)(ids).logits
        reference = hf_reference(tmp_path)(ids).logits
    assert (quantized - dequantized).abs().max() <= 1e-5
    assert (dequantized - reference).abs().max() <= 1e-4


def test_quantization_changes_weights_but_only_slightly():
    """The fp8/fp4 tiny checkpoint is a faithful quantization of the fp32 random weights."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.weights.writer import quantize_state_dict

    state = random_state_dict(tiny_config(), seed=3)
    q = quantize_state_dict(state, (32, 32), DeepseekV4ForCausalLM.fp32_param_markers)
    name = "layers.1.ffn.experts.0.w1.weight"
    back = dequantize_fp4(q[name], q[name[: -len("weight")] + "scale"])
    rel = (back - state[name]).norm() / state[name].norm()
    assert 0 < rel < 0.2
