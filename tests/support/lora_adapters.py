"""PEFT adapters for the LoRA tests, made with transformers + PEFT the way users make them."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
V4_TARGETS = ("wq_a", "wq_b", "wkv", "wo_b", "wgate", "weights_proj", "w1", "w2", "w3")


def hf_llama(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_lora_config(rng: random.Random, targets: tuple[str, ...], max_rank: int = 8) -> dict[str, Any]:
    """A random valid LoRA setup: a subset of the targets, rank, alpha, rsLoRA and a per-module
    rank override, so the tests cover what PEFT users set."""
    chosen = rng.sample(targets, rng.randint(1, len(targets)))
    r = rng.randint(1, max_rank)
    config = {
        "r": r,
        "lora_alpha": rng.choice([1, 4, 8, 16, 32]),
        "target_modules": chosen,
        "use_rslora": rng.random() < 0.5,
        "init_lora_weights": False,
    }
    if len(chosen) > 1 and rng.random() < 0.5:
        config["rank_pattern"] = {chosen[0]: rng.randint(1, max_rank)}
    return config


def make_adapter(model: torch.nn.Module, out: Path, config: dict[str, Any], seed: int, b_scale: float = 0.3):
    """Wrap a copy of ``model`` with PEFT's LoRA (random A and B: ``init_lora_weights=False``,
    B shrunk so the adapter changes tokens without swamping the base) and save it to ``out``;
    returns the PEFT model (unmerged, eval mode)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(str(out))
    return peft_model.eval()


def merged_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with the adapter's ``scale * B @ A`` added into its weights (PEFT's merge,
    written by hand so a model that PEFT cannot wrap can be the reference)."""
    import math
    import shutil

    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    out.mkdir(parents=True)
    for f in base.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    for f in base.glob("*.safetensors"):
        weights = load_file(str(f))
        for key in list(weights):
            module = key.removesuffix(".weight")
            a = tensors.get(f"base_model.model.{module}.lora_A.weight")
            if a is None:
                continue
            b = tensors[f"base_model.model.{module}.lora_B.weight"]
            r = a.shape[0]
            alpha = config["lora_alpha"]
            scale = alpha / (math.sqrt(r) if config["use_rslora"] else r)
            weights[key] = (weights[key].double() + scale * (b.double() @ a.double())).to(weights[key].dtype)
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out
