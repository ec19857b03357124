"""Engram n-gram memory: hashed n-gram lookups gated into the streams.

Three parts, each deterministic from the config and the tokenizer:

- the *compressed token map*: token ids whose normalised text is equal share one id
  (NFKC, NFD, strip accents, lowercase, whitespace runs -> one space, trimmed), so "The",
  " the" and "THE" hash alike;
- the *hash layout*: per Engram layer and n-gram size (2..max) and head, a distinct prime
  modulus (consecutive primes above ``engram_vocab_size - 1``), the table offsets (running sum
  of the primes), and one odd multiplier per look-back drawn from ``numpy``'s PCG64 seeded by
  ``10007 * layer_id``;
- the *gated lookup*: the ``(max_ngram - 1) * n_heads`` rows are concatenated, projected to one
  key per stream plus a shared value, and each stream adds the value scaled by a sigmoid gate of
  its normalised agreement with its key.

The rolling hash needs the previous ``max_ngram - 1`` compressed ids of every token; the engine
keeps them in the paged cache (see ``DeepseekV41ForCausalLM.cache_spec``), so the history
survives chunked prefill, decode, preemption and prefix-cache hits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.models.layers.gather import gather_rows

INT64_MAX = (1 << 63) - 1
DEAD = -1  # a position with no token (before the sequence, or an image span)
GATE_FLOOR = 1e-6


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), "\ue000"),  # protect a token that is one space
            normalizers.Strip(),
            normalizers.Replace("\ue000", " "),
        ]
    )


def build_compressed_token_map(tokenizer) -> list[int]:
    """``lookup[token_id] -> compressed id`` for every id of a Hugging Face ``tokenizers``
    ``Tokenizer`` (or a transformers fast tokenizer), ids numbered by first appearance.

    Each id is decoded on its own; partial UTF-8 (U+FFFD in the text) is keyed by the raw token
    string, and text that normalises to nothing keeps its decoded form.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    norm = _normalizer()
    keys: dict[str, int] = {}
    lookup = []
    for tid in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(tid) or text
        else:
            key = norm.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int) -> list[list[int]]:
    """Per layer, the ``(max_ngram - 1) * n_heads`` moduli, n-gram-major: each is the next
    prime above ``vocab_size - 1`` not already taken by an earlier (layer, n-gram, head)."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        row = []
        for _n in range(2, max_ngram + 1):
            cur = vocab_size - 1
            for _h in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                row.append(cur)
        out.append(row)
    return out


def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    """One odd multiplier per look-back, small enough that ``id * m`` cannot overflow int64."""
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    draws = rng.integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


@dataclass(frozen=True)
class EngramLayout:
    """Everything the hash needs, derived from the config (no learned parameters)."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: tuple[tuple[int, ...], ...]  # [layers][cols]
    offsets: tuple[tuple[int, ...], ...]  # [layers][cols], exclusive running sum of primes
    multipliers: tuple[tuple[int, ...], ...]  # [layers][max_ngram]

    @classmethod
    def build(
        cls, layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int, compressed_vocab: int
    ) -> EngramLayout:
        primes = engram_primes(layer_ids, max_ngram, n_heads, vocab_size)
        offsets = [tuple(int(v) for v in np.cumsum([0, *row[:-1]])) for row in primes]
        mults = [tuple(engram_multipliers(i, max_ngram, compressed_vocab)) for i in layer_ids]
        return cls(
            tuple(layer_ids), max_ngram, n_heads, tuple(map(tuple, primes)), tuple(offsets), tuple(mults)
        )

    @property
    def num_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def table_rows(self) -> list[int]:
        return [sum(row) for row in self.primes]


@functools.lru_cache(maxsize=8)
def _layout_tensors(layout: EngramLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Multipliers [L, n], primes and offsets [L, cols] as int64 tensors, made once per device."""
    return tuple(
        torch.tensor(v, dtype=torch.long, device=device)
        for v in (layout.multipliers, layout.primes, layout.offsets)
    )


def engram_hash_ids(history: torch.Tensor, layout: EngramLayout, pad: int) -> torch.Tensor:
    """Hash ids [T, layers, cols] from ``history`` [T, max_ngram] of compressed ids, column s
    holding the token s positions back (``DEAD`` where there is none). A dead look-back, and
    every longer one after it, reads as ``pad``; ids include each column's table offset."""
    blocked = torch.cummax((history < 0).long(), dim=1).values.bool()
    toks = torch.where(blocked, torch.full_like(history, pad), history)
    mult, primes, offsets = _layout_tensors(layout, history.device)
    products = toks.unsqueeze(1) * mult.unsqueeze(0)  # [T, L, n]
    rolling = products[..., 0]
    cols = []
    for s in range(1, layout.max_ngram):
        rolling = torch.bitwise_xor(rolling, products[..., s])
        cols.append(rolling.unsqueeze(-1).expand(-1, -1, layout.n_heads))
    hashed = torch.cat(cols, dim=-1)  # [T, L, cols], n-gram-major
    return torch.remainder(hashed, primes) + offsets


class EngramTable(nn.Module):
    """The hashed embedding rows. The released tables (~196B values) stay fp8 with one ue8m0
    scale per 32 channels and are dequantised per looked-up row; others load in compute dtype."""

    BLOCK = 32

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        # Runtime copy of the stored per-32 scales (ue8m0, one byte each), set by keep_stored.
        self.register_buffer("scale", None, persistent=False)

    def keep_stored(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Adopt the checkpoint's fp8 rows and their per-32 scales as they are."""
        expected = (weight.shape[0], weight.shape[1] // self.BLOCK)
        if tuple(scale.shape) != expected:
            raise ValueError(f"engram scale has shape {tuple(scale.shape)}, expected {expected}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = scale

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = gather_rows(self.weight, ids)
        if self.scale is None:
            return rows.to(dtype)
        scales = gather_rows(self.scale, ids).float()
        blocks = rows.float().unflatten(-1, (-1, self.BLOCK)) * scales.unsqueeze(-1)
        return blocks.flatten(-2).to(dtype)


class Engram(nn.Module):
    """Adds the gated n-gram value to each hyper-connection stream (before the block)."""

    def __init__(
        self, hidden: int, hc_mult: int, rows: int, head_dim: int, num_cols: int, eps: float
    ) -> None:
        super().__init__()
        self.hidden, self.hc_mult, self.eps = hidden, hc_mult, eps
        self.embed = EngramTable(rows, head_dim)
        self.wkv = nn.Linear(num_cols * head_dim, (hc_mult + 1) * hidden, bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, n, d], hash_ids [T, cols] -> streams [T, n, d]."""
        # rows in compute dtype: the projection's, or (resident fp8) the gating weights'
        dtype = self.wkv.weight.dtype if isinstance(self.wkv, nn.Linear) else self.q_weight.dtype
        rows = self.embed(hash_ids, dtype)  # [T, cols, head_dim]
        kv = self.wkv(rows.flatten(-2))
        key, value = kv.split([self.hc_mult * self.hidden, self.hidden], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden))
        h = streams.float()
        weight = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.hidden**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
