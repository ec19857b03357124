"""What the RL tests do to a trainer's module and compare: one optimizer step, a checkpoint of
its weights now, and outputs as tokens and logprobs compared exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from deepinfer.weights.writer import write_safetensors


def tokens_and_logprob_dicts(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each output's tokens and, per token, its logprobs by token id (compared exactly)."""
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
        for c in (o.outputs[0] for o in outputs)
    ]


def train_step(model: torch.nn.Module, seed: int, lr: float, length: int) -> None:
    """One SGD step on two random sequences of ``length`` tokens: every parameter that takes
    part is written in place, as a trainer's optimizer does."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 250, (2, length), generator=gen)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr).step()


def save_checkpoint(model: torch.nn.Module, like: Path, where: Path) -> Path:
    """A checkpoint directory of ``model``'s current weights beside ``like``'s config."""
    where.mkdir(parents=True)
    for f in Path(like).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, where / f.name)
    write_safetensors({n: t.detach().clone() for n, t in model.state_dict().items()}, where)
    return where
