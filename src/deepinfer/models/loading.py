"""``load_model``: a checkpoint directory (or a named model) to a ready ``nn.Module``.

The pieces come from below: the catalogue resolves names (``weights.catalog``), the registry
picks the architecture (``models.registry``), the loader fills its weights
(``weights.loader``), and the model's own hooks finish it (``CausalLM.post_load``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.errors import CheckpointError
from deepinfer.models.base import CausalLM
from deepinfer.models.registry import load_config_json, resolve
from deepinfer.platforms import resolve_device
from deepinfer.weights.catalog import NAMED_MODELS, resolve_model
from deepinfer.weights.loader import load_weights


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fake_quant: bool | None = None,
    requires_grad: bool = False,
    keep_quantized: bool = False,
) -> CausalLM:
    """Build the architecture named in ``config.json`` and load its weights.

    Returns the model in eval mode; ``model(input_ids, attention_mask=None, labels=None,
    output_hidden_states=False)`` gives a ``CausalLMOutput``, differentiable
    in the parameters when ``requires_grad`` (or after ``model.requires_grad_()``).
    ``fake_quant`` applies the QAT activation rounding of the released models; None takes the
    model's default (off for V4, as transformers 5.24 applies none; on for V4.1, whose
    reference forward rounds). ``keep_quantized`` keeps fp8-block linears and fp4 routed
    experts as stored (``Fp8BlockLinear``, ``MoE.keep_fp4``; what ``LLM`` does by default)
    instead of dequantizing them to ``dtype`` (differentiable float parameters).
    """
    device = resolve_device(device)
    path = resolve_model(path)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {path} does not exist (named models: {', '.join(NAMED_MODELS)})"
        )
    raw = load_config_json(path)
    cfg, cls = resolve(raw)
    if fake_quant and not hasattr(cfg, "fake_quant"):
        raise ValueError(f"fake_quant: {type(cfg).__name__} has no QAT fake-quant steps")
    if hasattr(cfg, "fake_quant") and fake_quant is not None:
        cfg.fake_quant = fake_quant
    with torch.device("meta"):
        model = cls(cfg)
    model.keep_quantized = keep_quantized
    model.allocate_stacked_experts(dtype, torch.device(device))
    # the parsed config knows the fp8 block size also when config.json is the flat reference one
    quant = getattr(cfg, "quantization", None) or raw.get("quantization_config")
    load_weights(model, path, dtype, torch.device(device), quant)
    model.post_load(path)
    model.requires_grad_(requires_grad)
    return model.eval()
