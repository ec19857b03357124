"""Perplexity, KL divergence and top-1 agreement over a text, by llama-perplexity's protocol.

The text is tokenized once and cut into ``ctx``-token chunks (as many whole chunks as it holds,
or ``chunks``); where the tokenizer adds a BOS token, each chunk's first token becomes BOS.
Each chunk is one request, and only the second half is scored: the distributions at positions
``ctx/2 .. ctx-2`` against the tokens that follow them (255 tokens a chunk at ``ctx=512``), so
every scored token sees at least half a window of context. Perplexity is ``exp`` of the mean
negative log-likelihood, with llama.cpp's uncertainty. Against a saved base
(``base_logprobs``): the mean KL divergence ``KL(base || this run)`` per scored token (summed,
as llama-perplexity sums it, over the tokens the base gives a log-probability above -16: the
tail left out holds at most e^-16 of the mass per token, yet its relative errors would add to
the sum) and the share of tokens whose most likely next token is the base's, with their
standard errors, as llama-perplexity's ``--kl-divergence`` reports them. The chunks are scored through the engine
itself (``SamplingParams.prompt_logprobs_full``), so every engine option (quantization, KV
cache type, compilation) is measured as it serves; scoring requests never read the prefix
cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from deepinfer.quality import base_logprobs
from deepinfer.sampling_params import SamplingParams

# base log-probabilities at or below this are left out of the KL sum (llama-perplexity's cut)
KL_FLOOR = -16.0


@dataclass
class PerplexityReport:
    """One run's figures (``*_err``: standard errors, as llama-perplexity prints them)."""

    ctx: int
    chunks: int
    scored_tokens: int
    ppl: float
    ppl_err: float
    kl: float | None = None
    kl_err: float | None = None
    top1: float | None = None  # share of scored tokens whose argmax is the base's
    top1_err: float | None = None

    def lines(self) -> list[str]:
        out = [
            f"chunks: {self.chunks} x {self.ctx} tokens, {self.scored_tokens} scored",
            f"PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f}",
        ]
        if self.kl is not None:
            out.append(f"Mean KLD: {self.kl:.6f} +/- {self.kl_err:.6f}")
            out.append(f"Same top p: {100 * self.top1:.3f} +/- {100 * self.top1_err:.3f} %")
        return out


def chunk_tokens(
    token_ids: list[int], ctx: int, chunks: int | None = None, bos_id: int | None = None
) -> torch.Tensor:
    """The text's tokens as [n, ctx] chunks (whole chunks only, at most ``chunks``), each
    starting with ``bos_id`` when given."""
    if ctx < 4 or ctx % 2:
        raise ValueError(f"ctx must be an even number of tokens >= 4, got {ctx}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if len(token_ids) < 2 * ctx:  # llama-perplexity's own minimum
        raise ValueError(
            f"the text has {len(token_ids)} tokens; scoring with ctx={ctx} needs at least {2 * ctx}"
        )
    n = len(token_ids) // ctx if chunks is None else min(chunks, len(token_ids) // ctx)
    out = torch.tensor(token_ids[: n * ctx], dtype=torch.int64).view(n, ctx)
    if bos_id is not None:
        out[:, 0] = bos_id
    return out


def added_bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer adds one to a text (llama.cpp's ``add_bos``), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def scored_logprobs(
    llm: Any, chunks: torch.Tensor, batch: int = 4
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk, in order: the log-probabilities at the scored positions [ctx-1-ctx/2, V]
    and the tokens they predict. ``batch`` chunks go to the engine at a time (each holds
    [ctx, V] fp32 log-probabilities until it is scored)."""
    ctx = chunks.shape[1]
    first = ctx // 2
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_full=True)
    for start in range(0, len(chunks), batch):
        group = chunks[start : start + batch]
        outputs = llm.generate([{"prompt_token_ids": c.tolist()} for c in group], params, use_tqdm=False)
        for chunk, out in zip(group, outputs, strict=True):
            full = out.prompt_logprobs_full
            if full is None or full.shape[0] != ctx - 1:
                raise RuntimeError(
                    f"the engine returned no full prompt log-probabilities for a chunk ({out.request_id})"
                )
            yield full[first : ctx - 1], chunk[first + 1 :]


class _Mean:
    """Running mean of a per-token figure, with its standard error (llama.cpp's formula)."""

    def __init__(self) -> None:
        self.sum = self.sum2 = 0.0
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        v = values.double()
        self.sum += v.sum().item()
        self.sum2 += (v * v).sum().item()
        self.count += v.numel()

    def mean_err(self) -> tuple[float, float]:
        mean = self.sum / self.count
        var = self.sum2 / self.count - mean * mean
        return mean, math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0


def perplexity(
    llm: Any,
    text: str | None = None,
    token_ids: list[int] | None = None,
    ctx: int = 512,
    chunks: int | None = None,
    batch: int = 4,
    save_logits: str | Path | None = None,
    kl_base: str | Path | None = None,
    progress: bool = False,
) -> PerplexityReport:
    """Score ``text`` (or ``token_ids``) with ``llm``: perplexity, and with ``kl_base`` the KL
    divergence and top-1 agreement against it; ``save_logits`` writes this run as a base."""
    if (text is None) == (token_ids is None):
        raise ValueError("give text or token_ids")
    bos = None
    if token_ids is None:
        token_ids = llm.tokenizer(text)["input_ids"]
        bos = added_bos(llm.tokenizer)
    table = chunk_tokens(token_ids, ctx, chunks, bos)
    base = base_logprobs.BaseLogprobs(kl_base) if kl_base is not None else None
    if base is not None:
        base.check(table)
    nll, kl, same = _Mean(), _Mean(), _Mean()
    saved: list[torch.Tensor] = []
    pairs = scored_logprobs(llm, table, batch)
    for i, (logp, targets) in enumerate(tqdm(pairs, total=len(table), disable=not progress, desc="chunks")):
        nll.add(-logp.gather(1, targets.unsqueeze(1)).squeeze(1))
        if save_logits is not None:
            saved.append(logp.clamp(min=-6e4).half())
        if base is not None:
            ref = base.chunk(i)
            counted = ref > KL_FLOOR  # llama.cpp's sum leaves out the base's tail
            kl.add(torch.where(counted, ref.exp() * (ref - logp), 0.0).sum(-1))
            same.add((ref.argmax(-1) == logp.argmax(-1)).float())
    if save_logits is not None:
        base_logprobs.save(save_logits, table, saved)
    mean, err = nll.mean_err()
    ppl = math.exp(mean)
    report = PerplexityReport(ctx, len(table), nll.count, ppl, err * ppl)
    if base is not None:
        report.kl, report.kl_err = kl.mean_err()
        report.top1 = same.sum / same.count
        report.top1_err = math.sqrt(report.top1 * (1 - report.top1) / (same.count - 1))
    return report
