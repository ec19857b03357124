"""Writing checkpoints: safetensors files (one, or shards with an index json) and the
DeepSeek release format's quantization (fp8 e4m3 block-scaled linears, fp4 e2m1 routed
experts, fp8 Engram rows), the inverse of what ``weights.loader`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.weights.quant import quantize_fp4, quantize_fp8_blocks

# Official fp8 checkpoints keep these in bf16 (compressor, indexer weights_proj, wo_a, gate).
FP8_LINEARS = (
    "attn.wq_a.",
    "attn.wq_b.",
    "attn.wkv.",
    "attn.wo_b.",
    "indexer.wq_b.",
    "shared_experts.",
    "engram.wkv.",
    "main_proj.",
)
# Engram tables: fp8 rows with one ue8m0 scale per 32 channels.
_FP8_ROW_TABLES = ("engram.embed.weight",)


def stored_format(name: str, t: torch.Tensor, fp32_markers: tuple[str, ...]) -> str:
    """How the release format stores tensor ``name``: "fp4" (routed experts), "fp8_rows"
    (Engram tables), "fp8" (block-scaled linears), "bf16", "fp32" (``fp32_markers``) or
    "int" (integer tensors, as they are)."""
    if ".experts." in name and name.endswith(".weight") and ".shared_experts." not in name:
        return "fp4"
    if name.endswith(_FP8_ROW_TABLES):
        return "fp8_rows"
    if name.endswith(".weight") and any(m in name for m in FP8_LINEARS):
        return "fp8"
    if not t.is_floating_point():
        return "int"
    return "fp32" if any(m in name for m in fp32_markers) else "bf16"


def quantize_state_dict(
    state: dict[str, torch.Tensor], block: tuple[int, int], fp32_markers: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """fp8 e4m3 block-scaled attention/shared-expert linears, fp4 routed experts, fp8 Engram
    rows with per-32 scales, bf16 rest (``fp32_markers``: the model's ``fp32_param_markers``,
    what stays fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        scale_name = name[: -len("weight")] + "scale"
        fmt = stored_format(name, t, fp32_markers)
        if fmt == "fp4":
            out[name], out[scale_name] = quantize_fp4(t)
        elif fmt == "fp8_rows":
            out[name], out[scale_name] = quantize_fp8_blocks(t, (1, 32))
        elif fmt == "fp8":
            out[name], out[scale_name] = quantize_fp8_blocks(t, block)
        elif fmt == "bf16":
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t
    return out


def write_safetensors(state: dict[str, torch.Tensor], path: Path, shards: int = 1) -> None:
    """Write one ``model.safetensors`` or ``shards`` files plus ``model.safetensors.index.json``."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if shards <= 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
