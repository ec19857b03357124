"""GGUF (llama.cpp) Llama checkpoints -> a Hugging Face layout directory.

Weights are read and dequantized with the ``gguf`` package; llama.cpp stores Q and K with
their rows permuted for its RoPE layout, which we undo. The tokenizer (with its chat
template) comes from ``transformers``' GGUF tokenizer conversion. The output directory is
written to a temporary sibling and renamed into place, so an interrupted conversion never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.errors import CheckpointError


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    if not name.startswith("blk."):
        return None
    _, layer, rest = name.split(".", 2)
    parts = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    return f"model.layers.{layer}.{parts[rest]}" if rest in parts else None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf_llama(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a Llama GGUF file into ``out_dir`` (config.json, model.safetensors, tokenizer)."""
    import gguf
    from safetensors.torch import save_file

    if not gguf_path.is_file():
        raise CheckpointError(f"GGUF file {gguf_path} does not exist")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # the reader raises several types on a bad file
        raise CheckpointError(
            f"{gguf_path}: not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{gguf_path}: unexpected tensor {t.name!r}")
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, n_kv)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    vocab = state["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent finisher: real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
