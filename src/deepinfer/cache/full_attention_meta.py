"""A dense (full-attention) step's metadata (``FullAttentionMeta``): each decode row's pool
rows and mask, and the prefill spans ``paged_attention`` reads."""

from __future__ import annotations

import numpy as np

from deepinfer.cache.forward_batch import FullAttentionMeta
from deepinfer.cache.host_tensors import host_tensor
from deepinfer.cache.pools import CacheLayout
from deepinfer.cache.step_chunks import MIN_ROWS, SeqChunk, StepPadding, padded_len
from deepinfer.cache.token_layout import TokenLayout


def _kv_rows(table: list[int], end: int, bs: int) -> np.ndarray:
    """Pool rows of positions 0 .. end-1 of a sequence with block table ``table``."""
    blocks = np.asarray(table[: (end + bs - 1) // bs], dtype=np.int64)
    return (blocks[:, None] * bs + np.arange(bs)).ravel()[:end]


def build(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    tokens: TokenLayout,
    padding: StepPadding | None = None,
) -> FullAttentionMeta:
    """Decode rows and prefill spans. Padding adds decode rows of -1 and spans of 0 tokens,
    which ``paged_attention`` skips; padded pool rows point at the null block. Built in NumPy:
    as a dozen small torch ops it was a visible share of a batch-1 Llama decode step."""
    bs = layout.block_size
    fixed_len = padding.max_model_len if padding is not None else None
    bases = tokens.base
    decode = [base for c, base in zip(chunks, bases, strict=True) if c.num_tokens == 1]
    real = len(decode)
    spans, span_rows, offset = [], [], 0  # offset: the span pool rows so far
    for c, base in zip(chunks, bases, strict=True):
        if c.num_tokens > 1:
            end = c.start + c.num_tokens
            spans.append([base, c.num_tokens, c.start, offset])
            span_rows.append(_kv_rows(c.block_table, end, bs))
            offset += end
    if padding is not None:
        null_row = padding.null_block * bs
        n_decode = padded_len(len(decode), len(chunks) if fixed_len is not None else None)
        decode += [-1] * (n_decode - len(decode))
        spans += [[0, 0, 0, 0]] * (padded_len(len(spans), None) - len(spans))
        span_rows.append(np.full(padded_len(offset, None) - offset, null_row, dtype=np.int64))
    rows = np.fromiter(decode, np.int64, len(decode))
    safe = np.maximum(rows, 0)
    pos = tokens.positions[safe]  # each decode token reads positions 0 .. pos
    length = int(pos[:real].max()) + 1 if real else 0  # padded rows (-1) read nothing
    if fixed_len is not None:
        length = fixed_len  # a captured graph reads max_model_len positions
    elif padding is not None:
        length = max(length, MIN_ROWS)
    q = np.arange(length)[None, :]
    valid = (q <= pos[:, None]) & (rows >= 0)[:, None]
    qc = np.where(valid, q, 0)
    kv = np.take_along_axis(tokens.token_block[safe], qc // bs, 1) * bs + qc % bs
    if padding is not None:
        kv = np.where(valid, kv, padding.null_block * bs)
    return FullAttentionMeta(
        host_tensor(rows),
        host_tensor(kv),
        host_tensor(valid),
        host_tensor(np.asarray(spans, dtype=np.int64).reshape(-1, 4)),  # stays on the CPU: read by the host
        host_tensor(np.concatenate(span_rows) if span_rows else np.zeros(0, dtype=np.int64)),
    )
