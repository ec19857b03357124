"""A dense (full-attention) step's metadata (``FullAttentionMeta``): each decode row's pool
rows and mask, and the prefill spans ``paged_attention`` reads."""

from __future__ import annotations

import numpy as np
import torch

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
    spans_meta = host_tensor(np.asarray(spans, dtype=np.int64).reshape(-1, 4))  # read by the host
    span_kv = host_tensor(np.concatenate(span_rows) if span_rows else np.zeros(0, dtype=np.int64))
    if fixed_len is not None:  # a captured graph reads max_model_len positions: the compact form
        assert padding is not None
        return _compact(
            rows, pos, tokens.token_block[safe], fixed_len, bs, padding.null_block, spans_meta, span_kv
        )
    length = int(pos[:real].max()) + 1 if real else 0  # padded rows (-1) read nothing
    if padding is not None:
        length = max(length, MIN_ROWS)
    q = np.arange(length)[None, :]
    valid = (q <= pos[:, None]) & (rows >= 0)[:, None]
    qc = np.where(valid, q, 0)
    kv = np.take_along_axis(tokens.token_block[safe], qc // bs, 1) * bs + qc % bs
    if padding is not None:
        kv = np.where(valid, kv, padding.null_block * bs)
    return FullAttentionMeta(host_tensor(rows), host_tensor(kv), host_tensor(valid), spans_meta, span_kv)


def _compact(
    rows: np.ndarray,
    pos: np.ndarray,
    tables: np.ndarray,
    length: int,
    bs: int,
    null_block: int,
    span_meta: torch.Tensor,
    span_kv: torch.Tensor,
) -> FullAttentionMeta:
    """The decode rows as their blocks and last positions (``FullAttentionMeta.expand`` makes
    the per-position rows on the device): L / block_size entries per row instead of L."""
    width = -(-length // bs)
    blocks = np.full((len(rows), width), null_block, dtype=np.int64)
    held = np.where(rows >= 0, pos // bs + 1, 0)  # blocks each row reads
    cols = min(width, tables.shape[1])
    inside = np.arange(cols)[None, :] < held[:, None]
    blocks[:, :cols] = np.where(inside, tables[:, :cols], null_block)
    last = np.where(rows >= 0, pos, -1)
    return FullAttentionMeta(
        host_tensor(rows),
        None,
        None,
        span_meta,
        span_kv,
        decode_blocks=host_tensor(blocks),
        decode_pos=host_tensor(last),
        block_size=bs,
        length=length,
        null_block=null_block,
    )
