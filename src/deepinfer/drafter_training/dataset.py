"""Self-distillation data for a DSpark head: the target's own replies to chat prompts, with
the hidden states the head reads and the target's distribution at every position.

Replies come from the engine (``LLM.chat``, greedy or sampled with a seed); features come from
the research forward (``load_model``), whose ``hidden_states[i]`` is the hidden state entering
layer ``i``, the same rows a serving engine hands the head. The target's distribution is kept
as its final normed hidden state (``d`` floats a position instead of ``V``): the trainer
multiplies it by the shared head when it needs the logits.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from deepinfer.llm import LLM
from deepinfer.models.loading import load_model
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams


@dataclass
class DistillSet:
    """Sequences laid end to end: ``tokens`` [N], ``starts`` [S + 1] (sequence s is
    ``tokens[starts[s]:starts[s + 1]]``), ``reply_starts`` [S] (each sequence's first reply
    position), ``features`` [N, m * d] and ``final`` [N, d] (the target's normed last hidden)."""

    tokens: torch.Tensor
    starts: torch.Tensor
    reply_starts: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.starts.numel() - 1

    def sequence(self, s: int) -> slice:
        return slice(int(self.starts[s]), int(self.starts[s + 1]))

    def subset(self, indices: list[int]) -> DistillSet:
        """The sequences ``indices`` as a set of their own."""
        parts = [self.sequence(s) for s in indices]
        lengths = torch.tensor([p.stop - p.start for p in parts])
        return DistillSet(
            torch.cat([self.tokens[p] for p in parts]),
            torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            self.reply_starts[indices].clone(),
            torch.cat([self.features[p] for p in parts]),
            torch.cat([self.final[p] for p in parts]),
        )

    def save(self, path: Path) -> None:
        save_file({k: v.contiguous() for k, v in vars(self).items()}, str(path))

    @classmethod
    def load(cls, path: Path) -> DistillSet:
        return cls(**load_file(str(path)))


def reply(
    llm: LLM,
    conversations: list[list[dict[str, str]]],
    params: SamplingParams | list[SamplingParams],
    use_tqdm: bool = False,
) -> list[RequestOutput]:
    """``LLM.chat`` in the model's chat format, or, for a model without one, the last
    message's words as a plain prompt."""
    if getattr(llm.tokenizer, "chat_template", None):
        return llm.chat(conversations, params, use_tqdm=use_tqdm)
    return llm.generate([c[-1]["content"] for c in conversations], params, use_tqdm=use_tqdm)


def generate_replies(
    model: str | Path,
    conversations: list[list[dict[str, str]]],
    max_tokens: int,
    sampled_fraction: float,
    seed: int,
    max_num_seqs: int = 32,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) of each conversation in the target's chat format (the plain
    text where it has none): greedy replies, and sampled ones (temperature 0.8, seeded) for
    the first ``sampled_fraction`` of them."""
    llm = LLM(str(model), max_num_seqs=max_num_seqs)
    n_sampled = int(round(sampled_fraction * len(conversations)))
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i)
        if i < n_sampled
        else SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for i in range(len(conversations))
    ]
    outs = reply(llm, conversations, params, use_tqdm=True)
    pairs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    del llm
    gc.collect()
    return pairs


@torch.inference_mode()
def target_features(
    model: str | Path, pairs: list[tuple[list[int], list[int]]], layer_ids: list[int]
) -> DistillSet:
    """Run the target over every (prompt, reply) and keep what training reads."""
    target = load_model(model)
    tokens, reply_starts, features, final = [], [], [], []
    for prompt, reply in tqdm(pairs, desc="target features", unit="seq"):
        ids = torch.tensor([prompt + reply])
        hidden = target(ids, output_hidden_states=True).hidden_states
        features.append(torch.cat([hidden[i][0] for i in layer_ids], dim=-1))
        final.append(target.model.norm(hidden[-1][0]))
        tokens.append(ids[0])
        reply_starts.append(len(prompt))
    lengths = torch.tensor([t.numel() for t in tokens])
    del target
    gc.collect()
    return DistillSet(
        torch.cat(tokens),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        torch.tensor(reply_starts),
        torch.cat(features),
        torch.cat(final),
    )
