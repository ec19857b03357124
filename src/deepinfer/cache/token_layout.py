"""A step's chunks as per-token and per-chunk NumPy arrays (``TokenLayout``), the shared input
of every part of the step's metadata (window rows, compressor groups, full attention)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from deepinfer.cache.step_chunks import SeqChunk, StepPadding


@dataclass
class TokenLayout:
    """Per-token and per-chunk facts of a step as NumPy arrays, shared by every ratio's
    bookkeeping (NumPy: a step's metadata is a few dozen small array operations, each several
    times cheaper there than as a torch op)."""

    positions: np.ndarray  # [T]
    seq_of_token: np.ndarray  # [T] index of the token's chunk
    token_block: np.ndarray  # [T, max_blocks] each token's block table
    window_block: np.ndarray  # [T, max_blocks] its window blocks (token_block unless bounded)
    slot: np.ndarray  # [T]
    end: np.ndarray  # [T] end position (exclusive) of the token's chunk
    base: list[int]  # first token row of each chunk
    chunk_start: np.ndarray  # [C]
    chunk_end: np.ndarray  # [C]
    chunk_slot: np.ndarray  # [C]
    chunk_base: np.ndarray  # [C]
    chunk_restore: np.ndarray  # [C] bool: the chunk follows a prefix-cache hit
    tables: np.ndarray  # [C, max_blocks] block tables (padded with 0)


def padded_table(rows: list[list[int]], fill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[len(rows), longest] int64: each row then ``fill``; and the rows' lengths."""
    sizes = np.fromiter(map(len, rows), np.int64, len(rows))
    width = int(sizes.max()) if len(rows) else 0
    out = np.full((len(rows), width), fill, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(sizes.sum()))
    out[np.arange(width) < sizes[:, None]] = flat
    return out, sizes


def align_window_tables(
    chunks: list[SeqChunk], rows: list[list[int] | None], width: int, table_sizes: np.ndarray
) -> np.ndarray:
    """[len(chunks), width]: each chunk's window table aligned with its block table, entries
    < 0 and columns past its block table's end at its ``window_null``. Here, not per request
    on the host: a Python list per sequence costs more than a few array operations per step."""
    try:  # a None among them fails the conversions (no separate pass over the chunks)
        nulls = np.fromiter((c.window_null for c in chunks), np.int64, len(chunks))  # type: ignore[misc]
        held, _ = padded_table(rows, fill=-1)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("a bounded window needs every chunk's window table and window_null") from None
    if held.shape[1] < width:
        held = np.pad(held, ((0, 0), (0, width - held.shape[1])), constant_values=-1)
    held = held[:, :width]
    out_of_table = np.arange(width) >= table_sizes[:, None]
    return np.where((held < 0) | out_of_table, nulls[:, None], held)


def build_token_layout(chunks: list[SeqChunk], padding: StepPadding | None) -> TokenLayout:
    """Per-token and per-chunk arrays of a step's chunks (padding chunks included)."""
    n = len(chunks)
    lengths = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
    starts = np.fromiter((c.start for c in chunks), np.int64, n)
    slots = np.fromiter((c.slot for c in chunks), np.int64, n)
    ends = starts + lengths
    first_row = np.cumsum(lengths) - lengths
    seq_of_token = np.repeat(np.arange(n), lengths)
    positions = starts[seq_of_token] + np.arange(int(lengths.sum())) - first_row[seq_of_token]
    tables, table_sizes = padded_table([c.block_table for c in chunks])
    window_tables = tables
    window_rows = [c.window_table for c in chunks]
    if any(row is not None for row in window_rows):
        window_tables = align_window_tables(chunks, window_rows, tables.shape[1], table_sizes)
    return TokenLayout(
        positions=positions,
        seq_of_token=seq_of_token,
        token_block=tables[seq_of_token],
        window_block=window_tables[seq_of_token],
        slot=slots[seq_of_token],
        end=ends[seq_of_token],
        base=first_row.tolist(),
        chunk_start=starts,
        chunk_end=ends,
        chunk_slot=slots,
        chunk_base=first_row,
        chunk_restore=np.fromiter((c.restore_overlap for c in chunks), bool, n),
        tables=tables,
    )
