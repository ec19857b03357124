"""``deepinfer train-drafter``: the whole recipe from a target to a served DSpark head.

1. replies of the target to chat prompts (``prompts.chat_prompts``), greedy and some sampled;
2. the target's features of every position (``dataset.target_features``), kept in the output
   directory so a second run with the same settings trains without generating again;
3. training (``train.train_head``), then calibration and evaluation on held-out greedy replies;
4. the head (``config.json`` + ``model.safetensors``), its training log and loss curve.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from deepinfer.drafter_training.dataset import DistillSet, generate_replies, target_features
from deepinfer.drafter_training.objective import TargetView, target_view
from deepinfer.drafter_training.prompts import chat_prompts
from deepinfer.drafter_training.train import (
    TrainOptions,
    draft_vocabulary,
    evaluate,
    reply_coverage,
    train_head,
)
from deepinfer.models.dspark_head import DSparkHeadConfig, check_target, save_head
from deepinfer.models.loading import load_model
from deepinfer.models.registry import load_config_json
from deepinfer.weights.catalog import resolve_model

DATA_FILE, DATA_SETTINGS, LOG_FILE = "distill.safetensors", "distill.json", "training_log.json"


def default_layers(num_layers: int, count: int = 4) -> list[int]:
    """``count`` target layers spread evenly over ``[1, num_layers - 1]`` (never the input
    embedding alone, never the last layer's output)."""
    count = min(count, num_layers - 1)
    if count < 1:
        raise ValueError(f"a DSpark head needs a target of at least 2 layers, got {num_layers}")
    span = num_layers - 2
    return sorted({1 + round(i * span / max(1, count - 1)) for i in range(count)})


def default_draft_vocab(vocab_size: int) -> int:
    """A draft vocabulary of 8192 tokens for vocabularies of 32768 and more, else none: a
    small head's logits cost the target's head's reads, and chat replies rarely leave the most
    frequent few thousand tokens (the recipe reports the held-out coverage)."""
    return 8192 if vocab_size >= 32768 else 0


def distill_data(model: Path, out: Path, settings: dict[str, Any], layers: list[int]) -> DistillSet:
    """The self-distillation set of ``settings``, generated or found in ``out``."""
    data_path, settings_path = out / DATA_FILE, out / DATA_SETTINGS
    if data_path.is_file() and settings_path.is_file() and json.loads(settings_path.read_text()) == settings:
        return DistillSet.load(data_path)
    conversations = chat_prompts(settings["prompts"], settings["seed"])
    pairs = generate_replies(
        model, conversations, settings["max_tokens"], settings["sampled_fraction"], settings["seed"]
    )
    data = target_features(model, pairs, layers)
    out.mkdir(parents=True, exist_ok=True)
    data.save(data_path)
    settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    return data


def target_rows(data: DistillSet, sequences: list[int]) -> torch.Tensor:
    """The rows of ``data`` that ``data.subset(sequences)`` holds, in its order."""
    return torch.cat([torch.arange(data.sequence(s).start, data.sequence(s).stop) for s in sequences])


def restrict(target: TargetView, rows: torch.Tensor) -> TargetView:
    """``target``'s per-row figures for a subset's rows."""
    return dataclasses.replace(target, lse=target.lse[rows], top=target.top[rows])


def last_layers(model: torch.nn.Module, count: int) -> list[dict[str, torch.Tensor]]:
    """The weights of the target's last ``count`` decoder layers, for the draft layers to
    start from (Llama names)."""
    out = []
    for layer in list(model.model.layers)[-count:]:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(
            {
                "q": attn.q_proj.weight.detach(),
                "k": attn.k_proj.weight.detach(),
                "v": attn.v_proj.weight.detach(),
                "o": attn.o_proj.weight.detach(),
                "gate": mlp.gate_proj.weight.detach(),
                "up": mlp.up_proj.weight.detach(),
                "down": mlp.down_proj.weight.detach(),
                "norm1": layer.input_layernorm.weight.detach(),
                "norm2": layer.post_attention_layernorm.weight.detach(),
            }
        )
    return out


def plot_losses(log: list[dict[str, float]], out: Path, title: str) -> None:
    """The loss and row-0 agreement curves as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key in ("loss", "tv", "ce", "confidence"):
        left.plot(steps, [e[key] for e in log], label=key)
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_title("training loss (weighted parts)")
    left.legend()
    for k in range(5):
        key = f"agree_{k}"
        if key in log[0]:
            right.plot(steps, [e[key] for e in log], label=f"row {k}")
    right.set_xlabel("step")
    right.set_title("argmax agreement with the target")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def train_drafter(
    model: str | Path,
    out: Path,
    prompts: int = 1280,
    max_tokens: int = 192,
    sampled_fraction: float = 0.25,
    held_out_fraction: float = 0.05,
    layers: list[int] | None = None,
    options: TrainOptions | None = None,
    head_shape: dict[str, Any] | None = None,
    plot: Path | None = None,
) -> dict[str, Any]:
    """Run the recipe; returns the summary written into the head's ``trained_for``."""
    options = options or TrainOptions()
    path = resolve_model(model)
    raw = load_config_json(path)
    hidden, vocab_size, num_layers = raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"]
    layers = layers or default_layers(num_layers)
    shape = {
        "draft_vocab_size": default_draft_vocab(vocab_size),
        "rope_theta": float(raw.get("rope_theta", 10000.0)),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
        **(head_shape or {}),
    }
    cfg = DSparkHeadConfig(hidden, vocab_size, list(layers), **shape)
    cfg.validate()
    check_target(cfg, hidden, vocab_size, num_layers)
    settings = {
        "model": str(model),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "sampled_fraction": sampled_fraction,
        "seed": options.seed,
        "layers": list(layers),
    }
    data = distill_data(path, out, settings, list(layers))
    # held out: the last greedy replies (the first sampled_fraction of the prompts are sampled)
    n_held = max(1, int(round(held_out_fraction * data.num_sequences)))
    held_ids = list(range(data.num_sequences - n_held, data.num_sequences))
    train_ids = list(range(data.num_sequences - n_held))
    held, train = data.subset(held_ids), data.subset(train_ids)
    model = load_model(path)
    embed = model.model.embed_tokens.weight.detach()
    output = model.head.weight_and_bias()[0]
    vocab = (
        draft_vocabulary(train, cfg.draft_vocab_size) if cfg.draft_vocab_size else torch.arange(vocab_size)
    )
    target = target_view(data, embed, output, vocab)
    train_rows = target_rows(data, train_ids)
    held_rows = target_rows(data, held_ids)
    result = train_head(train, cfg, restrict(target, train_rows), options, last_layers(model, cfg.num_layers))
    held_target = restrict(target, held_rows)
    raw_eval = evaluate(result.head, held, held_target, fit_temperatures=False)
    calibrated = evaluate(result.head, held, held_target, fit_temperatures=True)
    coverage = round(reply_coverage(held, vocab), 4) if cfg.draft_vocab_size else None
    summary = {
        "target": str(model),
        "settings": settings,
        "options": asdict(options),
        "train_sequences": train.num_sequences,
        "train_tokens": int(train.tokens.numel()),
        "held_out_sequences": held.num_sequences,
        "draft_vocab_coverage": coverage,
        "train_seconds": round(result.seconds, 1),
        "threads": torch.get_num_threads(),
        "held_out_raw": raw_eval.as_dict(),
        "held_out_calibrated": calibrated.as_dict(),
        "confidence_temperature": [round(float(t), 4) for t in result.head.confidence_temperature],
    }
    result.head.config.trained_for = summary
    save_head(result.head, out)
    (out / LOG_FILE).write_text(json.dumps({"summary": summary, "log": result.log}, indent=1) + "\n")
    if plot is not None:
        plot_losses(result.log, plot, f"DSpark head for {Path(str(model)).name}")
    return summary
