"""A base model's log-probabilities at the scored positions, saved so a quantized run can be
compared with them later (``--save-logits`` / ``--kl-base``), as llama-perplexity's
``--kl-divergence-base`` file is.

One safetensors file: the chunks' token ids (``tokens`` [chunks, ctx] int64, so a comparison
refuses other text or another tokenizer) and, per chunk, ``chunk.<i>`` [scored, vocab]
log-probabilities in fp16. fp16 keeps a log-probability near 0 (the tokens that carry a
distribution's mass) to 2^-11 relative, which moves KL divergences by far less than the
differences between quantizations; it halves what fp32 would take (about 25 MB per 512-token
chunk of a 49k vocabulary)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save(path: str | Path, tokens: torch.Tensor, chunks: list[torch.Tensor]) -> None:
    """Write ``tokens`` [chunks, ctx] and each chunk's scored log-probabilities."""
    tensors = {"tokens": tokens.to(torch.int64).contiguous()}
    # fp16's lowest finite value bounds the log-probabilities (none of a softmax's come near)
    tensors.update(
        {f"chunk.{i}": c.clamp(min=-6e4).to(torch.float16).contiguous() for i, c in enumerate(chunks)}
    )
    save_file(tensors, str(path), metadata={"format": "deepinfer-base-logprobs", "chunks": str(len(chunks))})


class BaseLogprobs:
    """A saved base, read a chunk at a time (the file may be larger than memory wants)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"--kl-base: no file {self.path}")
        self._file = safe_open(str(self.path), framework="pt")
        meta = self._file.metadata() or {}
        if meta.get("format") != "deepinfer-base-logprobs":
            raise ValueError(f"--kl-base: {self.path} is not a file written by --save-logits")
        self.tokens = self._file.get_tensor("tokens")
        self.num_chunks = int(meta["chunks"])

    def check(self, tokens: torch.Tensor) -> None:
        """Refuse a comparison over other tokens (other text, context size or tokenizer)."""
        n = min(len(tokens), self.num_chunks)
        if tokens.shape[1:] != self.tokens.shape[1:] or not torch.equal(tokens[:n], self.tokens[:n]):
            raise ValueError(
                f"--kl-base: {self.path} was computed over other tokens (text, --ctx or tokenizer differ)"
            )
        if len(tokens) > self.num_chunks:
            raise ValueError(
                f"--kl-base: {self.path} holds {self.num_chunks} chunks; this run scores {len(tokens)}"
            )

    def chunk(self, i: int) -> torch.Tensor:
        return self._file.get_tensor(f"chunk.{i}").float()
