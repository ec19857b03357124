"""Tiny checkpoints for tests, examples and benchmarks (a public utility: users build one too).

``make_tiny_checkpoint`` writes ``config.json`` in the released DeepSeek-V4-Flash format and
safetensors in the official tensor layout, with random weights scaled so that every block
does visible work. No network is needed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from deepinfer.models.registry import resolve
from deepinfer.weights.writer import quantize_state_dict, write_safetensors

BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2
LLAMA_BRANCH_GAIN = 8.0
TINY_VOCAB = 258  # <bos>, <eos>, then one token per byte

_V4_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "sliding_window": 8,
    # sliding (hash MoE), CSA ratio 4, HCA ratio 128, CSA, sliding; + 1 MTP entry as released
    "compress_ratios": [0, 4, 128, 4, 0, 0],
    "num_hash_layers": 1,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 4,  # not saturated once a sequence passes 16 tokens
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

# Same blocks with short groups (HF spelling: layer_types + compress_rates): HCA groups close
# every 8 tokens and the indexer is saturated, so long-range behaviour is cheap to test.
_V4_TINY_SHORT_GROUPS: dict[str, Any] = {
    **{k: v for k, v in _V4_TINY.items() if k not in ("compress_ratios", "num_hash_layers")},
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "index_topk": 64,
}

# V4.1-Flash: every block type in 6 layers (SWA, Engram, ratio-2 source and
# reuse, ratio-1 source = candidate source, ratio-1 reindex inside candidates) + 3 DSpark
# stages, in the released composite layout (``text_config``). index_topk 4 and 2 candidate
# blocks of 4 are not saturated once a sequence passes 8 compressed entries.
_V41_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": TINY_VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "engram_layer_ids": [1, 3],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 31,
    "engram_num_embeddings": [152, 220],  # sums of the derived primes per layer
    "engram_compressed_vocab_size": 229,  # the byte tokenizer's normalised map
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 4,
    "dspark_noise_token_id": TINY_VOCAB - 1,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 1,
    "max_position_embeddings": 4096,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}
_V41_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "image_token_id": TINY_VOCAB - 2,
    "text_config": _V41_TEXT,
    "vision_config": {"model_type": "deepseek_v41_vision"},
    "torch_dtype": "float32",
}
# The same blocks with top-k and candidates saturated: every visible entry is chosen.
_V41_TINY_SATURATED: dict[str, Any] = {
    **_V41_TINY,
    "text_config": {**_V41_TEXT, "index_topk": 1024, "candidate_topk_blocks": 1024},
}

_LLAMA_TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v4": _V4_TINY,
    "deepseek_v4_short_groups": _V4_TINY_SHORT_GROUPS,
    "deepseek_v41": _V41_TINY,
    "deepseek_v41_saturated": _V41_TINY_SATURATED,
    "llama": _LLAMA_TINY,
    "llama_untied_llama3_rope": {
        **_LLAMA_TINY,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def tiny_config(arch: str = "deepseek_v4", **overrides: Any) -> dict[str, Any]:
    """The raw ``config.json`` dict of a tiny architecture, with optional field overrides
    (applied inside ``text_config`` for composite configs)."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch={arch!r} is not a tiny architecture; choose one of {sorted(TINY_CONFIGS)}")
    raw = copy.deepcopy(TINY_CONFIGS[arch])
    if "text_config" in raw:
        raw["text_config"].update(overrides)
        return raw
    return {**raw, **overrides}


def random_state_dict(raw_config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """fp32 random weights in the official layout for ``raw_config``."""
    cfg, cls = resolve(raw_config)
    with torch.device("meta"):
        model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    state: dict[str, torch.Tensor] = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        shape = tuple(p.shape)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
            state[name] = torch.stack(rows).to(torch.int32)
        elif name.endswith("norm.weight"):
            state[name] = 1.0 + randn(*shape, std=0.1)
        elif leaf.endswith("_fn"):
            state[name] = randn(*shape, std=0.5 / math.sqrt(shape[1]))
        elif leaf.endswith("_base"):
            state[name] = randn(*shape, std=0.5)
        elif leaf.endswith("_scale"):
            state[name] = 0.5 + torch.rand(*shape, generator=gen)
        elif leaf in ("q_weight", "k_weight"):
            state[name] = 1.0 + randn(*shape, std=0.5)
        elif leaf in ("attn_sink", "ape", "bias"):
            state[name] = randn(*shape, std=0.5)
        elif name in ("embed.weight", "model.embed_tokens.weight") or name.endswith("engram.embed.weight"):
            state[name] = randn(*shape, std=1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # Llama's residual writers
            # outweigh the token's own embedding: with a tied head a weaker residual branch
            # makes the model repeat its last input token whatever the context
            state[name] = randn(*shape, std=LLAMA_BRANCH_GAIN / math.sqrt(shape[-1]))
        else:  # linear weights: unit-variance outputs so every block does visible work
            state[name] = randn(*shape, std=1.0 / math.sqrt(shape[-1]))
    return state


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (``<bos>``, ``<eos>``, 256 bytes) so tiny models speak text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda ch: _byte_of(ch))
    vocab = {"<bos>": BOS_ID, "<eos>": EOS_ID} | {ch: BYTE_OFFSET + i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(str(path))


def _byte_of(ch: str) -> int:
    """GPT-2's byte<->unicode map: printable bytes map to themselves, the rest to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "deepseek_v4",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    quant: str | None = None,
    shards: int = 1,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint (config.json + safetensors [+ tokenizer]) to ``path``.

    ``quant="fp8"`` stores fp8 e4m3 block-scaled linears and fp4 e2m1 routed experts, as
    the released checkpoints do; otherwise weights are stored in ``dtype``.
    """
    if quant not in (None, "fp8"):
        raise ValueError(f"quant must be None or 'fp8', got {quant!r}")
    if quant == "fp8" and not arch.startswith("deepseek"):
        raise ValueError("quant='fp8' stores the DeepSeek release format; use it with a deepseek arch")
    path = Path(path)
    raw = tiny_config(arch, **config_overrides)
    text = raw.get("text_config", raw)
    if not tokenizer and text.get("engram_layer_ids"):
        text["engram_compressed_vocab_size"] = text["vocab_size"]  # identity map without a tokenizer
    state = random_state_dict(raw, seed)
    if quant == "fp8":
        block = (32, 32)
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        }
        raw["expert_dtype"] = "fp4"
        raw["torch_dtype"] = "bfloat16"
        _, cls = resolve(raw)
        state = quantize_state_dict(state, block, cls.fp32_param_markers)
    else:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_safetensors(state, path, shards=shards)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    if tokenizer:
        write_byte_tokenizer(path)
    return path
