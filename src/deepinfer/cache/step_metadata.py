"""The step-metadata builder: turns one step's chunks (which positions of which sequences
run, and where their blocks are) into a ``ForwardBatch`` of index tensors, so the layers do
only gathers, math and scatters. ``StepPadding`` keeps the tensor shapes independent of the
step's contents for compiled steps and captured graphs.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.cache import native_group_meta
from deepinfer.cache.forward_batch import ForwardBatch, FullAttentionMeta, GroupMeta, LayerPools
from deepinfer.cache.pools import CacheLayout


@dataclass(frozen=True)
class StepPadding:
    """How a step is padded so its tensor shapes do not follow the batch's contents.

    Padded rows read and write only the *null* block and slot, which ``allocate_pools``
    reserves past the usable ones and no sequence ever owns; their outputs are discarded.

    - ``num_tokens``: pad the step with one-token null chunks up to this many tokens (a CUDA
      graph bucket); None keeps the step's own token count, but at least ``MIN_ROWS``.
    - ``max_model_len``: set for graph capture: every metadata tensor then takes the largest
      size a step of ``num_tokens`` decode tokens can need, so one shape serves the bucket.
      Without it each metadata tensor is padded to at least ``MIN_ROWS`` rows, so sizes 0 and
      1 (which ``torch.compile`` specialises) never reach the compiled step.
    """

    null_block: int
    null_slot: int
    num_tokens: int | None = None
    max_model_len: int | None = None
    null_window_block: int | None = None  # the window pool's null block (a bounded window)

    @classmethod
    def for_pools(cls, num_blocks: int, num_slots: int, **kw) -> StepPadding:
        return cls(null_block=num_blocks, null_slot=num_slots, **kw)


MIN_ROWS = 2


def _padded_len(n: int, fixed: int | None) -> int:
    if fixed is not None:
        if n > fixed:
            raise ValueError(f"step needs {n} rows, more than the padded size {fixed}")
        return fixed
    return max(n, MIN_ROWS)


@dataclass
class SeqChunk:
    """One sequence's part of a step: which positions run, where its cache lives."""

    block_table: list[int]
    slot: int
    start: int  # first position computed this step (tokens before it are cached)
    num_tokens: int
    restore_overlap: bool = False  # start follows a prefix-cache hit: restore the snapshot
    logits_offsets: list[int] = field(default_factory=list)  # chunk offsets needing logits
    replay_from: int = 0  # CED prefill: positions before this run the encoder layers only
    feature_offsets: list[int] | None = None  # chunk offsets whose draft features are returned
    # window-pool block of each of ``block_table``'s blocks, as the request holds them (a
    # bounded window): entries < 0 (given back, or not taken) and blocks past the table's end
    # read ``window_null``, the window pool's null block; None: the window sits in block_table
    window_table: list[int] | None = None
    window_null: int | None = None


@dataclass
class _TokenLayout:
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


# A compressor row a step reads (its kv and gate projections), coded as one int so that
# every row of every closed group is one entry of an integer array:
# >= 0: a token row of this step (projected now); -(2p + 1): row p of the slot's open-group
# buffer pool; -(2p + 2): row p of its overlap pool (a copy of its last closed group).
PADDING_ROW = 0  # what padded entries point at (outputs discarded)


def _source_rows(tokens: _TokenLayout, chunk: np.ndarray, group: np.ndarray, ratio: int) -> np.ndarray:
    """[G, ratio] coded source rows of the positions of groups ``group`` of chunks ``chunk``:
    computed now if the chunk covers the position; else in the open group's buffer (same
    group as the chunk's start) or in the overlap copy (the group before that)."""
    q = group[:, None] * ratio + np.arange(ratio)
    start = tokens.chunk_start[chunk][:, None]
    token_row = tokens.chunk_base[chunk][:, None] + q - start
    pool_row = tokens.chunk_slot[chunk][:, None] * ratio + q % ratio
    in_buffer = q >= (start // ratio) * ratio
    return np.where(q >= start, token_row, np.where(in_buffer, -2 * pool_row - 1, -2 * pool_row - 2))


@dataclass
class _ClosedGroups:
    """The groups of one ratio that close in a step, and the copies that follow from them,
    as integer arrays of rows coded as ``_source_rows`` returns them (groups in chunk order,
    then position order)."""

    members: np.ndarray  # [G, r] each group's rows
    previous: np.ndarray  # [G, r] the group before (rows of -1: none)
    has_previous: np.ndarray  # [G] bool
    first_position: np.ndarray  # [G]
    entry_row: np.ndarray  # [G] entry-pool row receiving its entry
    overlap_from: np.ndarray  # a sequence's newest group ...
    overlap_to: np.ndarray  # ... becomes its overlap rows
    snapshot_from: np.ndarray  # a group ending a block ...
    snapshot_to: np.ndarray  # ... is kept as that block's snapshot
    restore_from: np.ndarray  # a prefix hit's snapshot rows ...
    restore_to: np.ndarray  # ... restored into the slot's overlap

    def pool_rows_read(self) -> tuple[np.ndarray, np.ndarray]:
        """The buffer-pool and overlap-pool rows this step reads, sorted, each once."""
        rows = np.concatenate(
            [
                self.members.ravel(),
                self.previous[self.has_previous].ravel(),
                self.overlap_from,
                self.snapshot_from,
            ]
        )
        rows = rows[rows < 0]
        buffer = rows[rows % 2 == 1]
        overlap = rows[rows % 2 == 0]
        return np.unique((-buffer - 1) // 2), np.unique((-overlap - 2) // 2)


def _closed_groups(layout: CacheLayout, tokens: _TokenLayout, ratio: int) -> _ClosedGroups:
    """Every group the chunks close (decode steps close at most one per sequence), as arrays:
    one NumPy expression per field, whatever the number of sequences."""
    bs, r = layout.block_size, ratio
    epb = bs // r
    lo, hi = tokens.chunk_start // r, tokens.chunk_end // r
    count = hi - lo
    chunk = np.repeat(np.arange(len(count)), count)
    group = lo[chunk] + np.arange(len(chunk)) - np.repeat(np.cumsum(count) - count, count)
    members = _source_rows(tokens, chunk, group, r)
    has_previous = group > 0
    previous = np.where(has_previous[:, None], _source_rows(tokens, chunk, group - 1, r), -1)
    entry_row = tokens.tables[chunk, group // epb] * epb + group % epb
    ends_block = (group + 1) * r % bs == 0  # the group ends a block: snapshot the overlap there
    snapshot_block = tokens.tables[chunk[ends_block], ((group[ends_block] + 1) * r - 1) // bs]
    closes = count > 0
    newest = np.cumsum(count)[closes] - 1
    # a prefix hit restores the snapshot kept with the block before its start
    restoring = tokens.chunk_restore & (tokens.chunk_start > 0)
    restore_block = tokens.tables[restoring, tokens.chunk_start[restoring] // bs - 1]
    lanes = np.arange(r)
    return _ClosedGroups(
        members=members,
        previous=previous,
        has_previous=has_previous,
        first_position=group * r,
        entry_row=entry_row,
        overlap_from=members[newest].ravel(),
        overlap_to=(tokens.chunk_slot[closes][:, None] * r + lanes).ravel(),
        snapshot_from=members[ends_block].ravel(),
        snapshot_to=(snapshot_block[:, None] * r + lanes).ravel(),
        restore_from=(restore_block[:, None] * r + lanes).ravel(),
        restore_to=(tokens.chunk_slot[restoring][:, None] * r + lanes).ravel(),
    )


def _pad_to(values: np.ndarray, fill: int, bound: int | None) -> np.ndarray:
    extra = _padded_len(len(values), bound) - len(values)
    return np.concatenate([values, np.full(extra, fill, dtype=np.int64)]) if extra else values


def _pad_rows(rows: np.ndarray, fill: int, bound: int | None) -> np.ndarray:
    """``rows`` [G, r] with rows of ``fill`` appended up to the padded length."""
    extra = _padded_len(rows.shape[0], bound) - rows.shape[0]
    if not extra:
        return rows
    return np.concatenate([rows, np.full((extra, rows.shape[1]), fill, dtype=np.int64)])


def _pad_closed_groups(
    groups: _ClosedGroups, padding: StepPadding, ratio: int, epb: int, t_total: int
) -> _ClosedGroups:
    """Every array padded with entries that touch only the null block or slot. With
    ``max_model_len`` (a captured bucket) each takes the largest size a decode step of
    ``t_total`` tokens can need, so the shapes do not follow the step's contents."""
    fixed = padding.max_model_len is not None
    per_row = t_total * ratio if fixed else None  # rows of at most one group per token
    per_group = t_total if fixed else None
    null_slot_row, null_snapshot_row = padding.null_slot * ratio, padding.null_block * ratio
    members = _pad_rows(groups.members, PADDING_ROW, per_group)
    extra = members.shape[0] - groups.members.shape[0]
    return _ClosedGroups(
        members=members,
        previous=_pad_rows(groups.previous, -1, per_group),
        has_previous=np.concatenate([groups.has_previous, np.zeros(extra, dtype=bool)]),
        first_position=_pad_to(groups.first_position, 0, per_group),
        entry_row=_pad_to(groups.entry_row, padding.null_block * epb, per_group),
        overlap_from=_pad_to(groups.overlap_from, PADDING_ROW, per_row),
        overlap_to=_pad_to(groups.overlap_to, null_slot_row, per_row),
        snapshot_from=_pad_to(groups.snapshot_from, PADDING_ROW, per_row),
        snapshot_to=_pad_to(groups.snapshot_to, null_snapshot_row, per_row),
        restore_from=_pad_to(groups.restore_from, null_snapshot_row, per_row),
        restore_to=_pad_to(groups.restore_to, null_slot_row, per_row),
    )


def _numbering(t_total: int, buffer_rows: np.ndarray, overlap_rows: np.ndarray, num_buffer: int):
    """Coded rows -> rows of the gathered source cat(step rows [T], buffer rows, overlap rows)
    (``num_buffer``: the buffer rows' padded count)."""

    def numbered(rows: np.ndarray) -> np.ndarray:
        out = rows.copy()
        buffer = (rows < 0) & (rows % 2 == 1)
        overlap = (rows < 0) & (rows % 2 == 0)
        out[buffer] = t_total + np.searchsorted(buffer_rows, (-rows[buffer] - 1) // 2)
        out[overlap] = t_total + num_buffer + np.searchsorted(overlap_rows, (-rows[overlap] - 2) // 2)
        return out

    return numbered


def _group_meta(
    layout: CacheLayout,
    ratio: int,
    tokens: _TokenLayout,
    padding: StepPadding | None,
) -> GroupMeta:
    """Compressor bookkeeping for one ratio (see ``GroupMeta``): the compiled builder where
    it loaded (``native_group_meta``), else the NumPy one; both give the same fields."""
    if native_group_meta.available():
        fields = native_group_meta.build(layout.block_size, ratio, tokens, padding, MIN_ROWS)
        if fields is not None:
            return GroupMeta(**fields)
    return _group_meta_numpy(layout, ratio, tokens, padding)


def _group_meta_numpy(
    layout: CacheLayout,
    ratio: int,
    tokens: _TokenLayout,
    padding: StepPadding | None,
) -> GroupMeta:
    """``_group_meta`` vectorised over sequences and groups in NumPy (a Python walk over
    every closed group grows with the batch and was a visible share of a large step)."""
    r = ratio
    epb = layout.block_size // r  # entries per block
    t_total = int(tokens.positions.shape[0])
    groups = _closed_groups(layout, tokens, r)

    # Rows of earlier steps that this step reads, by pool.
    buffer_rows, overlap_rows = groups.pool_rows_read()
    padded_buffer, padded_overlap = buffer_rows, overlap_rows

    # Tokens past their chunk's last group boundary start or extend its open group.
    pos = tokens.positions
    in_open_group = pos >= (tokens.end // r) * r
    buf_src = np.flatnonzero(in_open_group)
    buf_dst = tokens.slot[buf_src] * r + pos[buf_src] % r
    visible = (pos + 1) // r  # entries each token may read
    num_entries = int(visible.max()) if visible.size else 0

    if padding is not None:
        groups = _pad_closed_groups(groups, padding, r, epb, t_total)
        fixed = padding.max_model_len is not None
        per_row = t_total * r if fixed else None
        padded_buffer = _pad_to(buffer_rows, padding.null_slot * r, per_row)
        padded_overlap = _pad_to(overlap_rows, padding.null_slot * r, per_row)
        buf_src = _pad_to(buf_src, 0, t_total if fixed else None)
        buf_dst = _pad_to(buf_dst, padding.null_slot * r, t_total if fixed else None)
        num_entries = padding.max_model_len // r if fixed else max(num_entries, MIN_ROWS)

    numbered = _numbering(t_total, buffer_rows, overlap_rows, len(padded_buffer))
    j = np.arange(num_entries)
    block_col = np.minimum(j // epb, tokens.token_block.shape[1] - 1)
    entry_valid = j[None, :] < visible[:, None]
    entry_idx = tokens.token_block[:, block_col] * epb + j % epb
    if padding is not None:  # entries past a sequence's table point at the null block
        entry_idx = np.where(entry_valid, entry_idx, padding.null_block * epb)
    tensor = _tensor
    return GroupMeta(
        src_buf_rows=tensor(padded_buffer),
        src_ovl_rows=tensor(padded_overlap),
        group_rows=tensor(numbered(groups.members).reshape(-1, r)),
        prev_rows=tensor(
            np.where(groups.has_previous[:, None], numbered(groups.previous), -1).reshape(-1, r)
        ),
        group_pos=tensor(groups.first_position),
        entry_slot=tensor(groups.entry_row),
        buf_src=tensor(buf_src),
        buf_dst=tensor(buf_dst),
        ovl_src=tensor(numbered(groups.overlap_from)),
        ovl_dst=tensor(groups.overlap_to),
        snap_src=tensor(numbered(groups.snapshot_from)),
        snap_dst=tensor(groups.snapshot_to),
        restore_src=tensor(groups.restore_from),
        restore_dst=tensor(groups.restore_to),
        entry_idx=tensor(entry_idx),
        entry_valid=tensor(entry_valid),
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> ``device`` without blocking the host: from pinned memory on CUDA, so building
    step N+1 never waits for step N's kernels (asynchronous scheduling)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_forward_batch(
    layout: CacheLayout,
    pools: list[LayerPools],
    chunks: list[SeqChunk],
    device: torch.device,
    padding: StepPadding | None = None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """Positions [T] and the ForwardBatch for a step made of ``chunks`` (in token order).

    Every index tensor is computed on the host and copied to ``device`` once at the end, so
    the data-dependent sizes (``nonzero``, maxima) never read device memory: no device sync
    on the thread that prepares the next step. ``span_meta`` stays on the host.

    With ``padding`` the step may hold extra null tokens after the real ones (their input ids
    are the caller's to append, any valid id) and padded metadata; see ``StepPadding``."""
    positions, batch = _build_on_host(layout, pools, chunks, padding)
    if device.type == "cpu":  # already there (mapping every field would cost time every step)
        return positions, batch
    moved = batch.map_metadata(lambda t: to_device(t, device), keep_on_host=("span_meta",))
    return to_device(positions, device), moved


# chunk fields read for every chunk of a step, as C-level getters (``map`` over a step's
# chunks without a Python frame per chunk)
_NUM_TOKENS = operator.attrgetter("num_tokens")
_FEATURE_OFFSETS = operator.attrgetter("feature_offsets")
_REPLAY_FROM = operator.attrgetter("replay_from")
_IS_NONE = functools.partial(operator.is_, None)


def _padded_chunks(chunks: list[SeqChunk], padding: StepPadding | None) -> list[SeqChunk]:
    """``chunks`` followed by one-token null chunks up to the padded token count."""
    if padding is None:
        return chunks
    real = sum(map(_NUM_TOKENS, chunks))
    target = _padded_len(real, padding.num_tokens)
    null_window = padding.null_window_block
    null = SeqChunk(
        [padding.null_block],
        padding.null_slot,
        0,
        1,
        window_table=None if null_window is None else [null_window],
        window_null=null_window,
    )
    return chunks + [null] * (target - real)


def _padded_table(rows: list[list[int]], fill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[len(rows), longest] int64: each row then ``fill``; and the rows' lengths."""
    sizes = np.fromiter(map(len, rows), np.int64, len(rows))
    width = int(sizes.max()) if len(rows) else 0
    out = np.full((len(rows), width), fill, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(sizes.sum()))
    out[np.arange(width) < sizes[:, None]] = flat
    return out, sizes


def _window_tables(
    chunks: list[SeqChunk], rows: list[list[int] | None], width: int, table_sizes: np.ndarray
) -> np.ndarray:
    """[len(chunks), width]: each chunk's window table aligned with its block table, entries
    < 0 and columns past its block table's end at its ``window_null``. Here, not per request
    on the host: a Python list per sequence costs more than a few array operations per step."""
    try:  # a None among them fails the conversions (no separate pass over the chunks)
        nulls = np.fromiter((c.window_null for c in chunks), np.int64, len(chunks))  # type: ignore[misc]
        held, _ = _padded_table(rows, fill=-1)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("a bounded window needs every chunk's window table and window_null") from None
    if held.shape[1] < width:
        held = np.pad(held, ((0, 0), (0, width - held.shape[1])), constant_values=-1)
    held = held[:, :width]
    out_of_table = np.arange(width) >= table_sizes[:, None]
    return np.where((held < 0) | out_of_table, nulls[:, None], held)


def _token_layout(chunks: list[SeqChunk], padding: StepPadding | None) -> _TokenLayout:
    """Per-token and per-chunk arrays of a step's chunks (padding chunks included)."""
    n = len(chunks)
    lengths = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
    starts = np.fromiter((c.start for c in chunks), np.int64, n)
    slots = np.fromiter((c.slot for c in chunks), np.int64, n)
    ends = starts + lengths
    first_row = np.cumsum(lengths) - lengths
    seq_of_token = np.repeat(np.arange(n), lengths)
    positions = starts[seq_of_token] + np.arange(int(lengths.sum())) - first_row[seq_of_token]
    tables, table_sizes = _padded_table([c.block_table for c in chunks])
    window_tables = tables
    window_rows = [c.window_table for c in chunks]
    if any(row is not None for row in window_rows):
        window_tables = _window_tables(chunks, window_rows, tables.shape[1], table_sizes)
    return _TokenLayout(
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


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` on the host through NumPy, whose conversion of
    a list of ints is several times faster."""
    return torch.from_numpy(np.fromiter(values, np.int64, len(values)))


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A host tensor over a NumPy array's memory (C-contiguous, as the compiled step's guards
    expect of every metadata tensor)."""
    return torch.from_numpy(np.ascontiguousarray(values))


def _build_on_host(
    layout: CacheLayout,
    pools: list[LayerPools],
    chunks: list[SeqChunk],
    padding: StepPadding | None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """``build_forward_batch``'s work; every tensor is made on the host (CPU)."""
    bs, w = layout.block_size, layout.window
    chunks = _padded_chunks(chunks, padding)
    tokens = _token_layout(chunks, padding)
    positions = tokens.positions

    def rows_at(q: np.ndarray) -> np.ndarray:
        """Window-pool rows of positions ``q`` [T, n] of each token's sequence."""
        qc = np.maximum(q, 0)
        return np.take_along_axis(tokens.window_block, qc // bs, 1) * bs + qc % bs

    window_q = positions[:, None] - np.arange(w)  # [T, W]
    window_valid = window_q >= 0
    logits_idx = [base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.logits_offsets]
    real_logits = len(logits_idx)
    feature_idx = None
    if not all(map(_IS_NONE, map(_FEATURE_OFFSETS, chunks))):
        rows = [
            base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.feature_offsets or ()
        ]
        if padding is not None:
            rows += [0] * (_padded_len(len(rows), None) - len(rows))
        feature_idx = torch.tensor(rows, dtype=torch.long)
    batch = ForwardBatch(
        pools=pools,
        window_idx=_tensor(rows_at(window_q)),
        window_valid=_tensor(window_valid),
        window_write=_tensor(rows_at(positions[:, None])[:, 0]),
        logits_idx=None,  # set below, padded or not
        feature_idx=feature_idx,
    )
    for ratio in layout.ratios:
        batch.groups[ratio] = _group_meta(layout, ratio, tokens, padding)
    if any(map(_REPLAY_FROM, chunks)):  # replay_from >= 0: some chunk replays
        replay = np.fromiter((c.replay_from for c in chunks), np.int64, len(chunks))[tokens.seq_of_token]
        rows = np.flatnonzero(positions >= replay)
        decoder_valid = window_valid & (window_q >= replay[:, None])
        if rows.size < positions.size or not np.array_equal(decoder_valid, window_valid):
            batch.decoder_rows, batch.decoder_window_valid = _tensor(rows), _tensor(decoder_valid)
    if padding is not None:
        # extra logits rows repeat a real row's logits (callers index real rows only): the
        # first requested row, or a row that runs the decoder layers (CED skips some)
        fixed = len(chunks) if padding.max_model_len is not None else None
        pad = logits_idx[0] if logits_idx else 0
        if not logits_idx and batch.decoder_rows is not None and batch.decoder_rows.numel():
            pad = int(batch.decoder_rows[0])
        extra = _padded_len(real_logits, fixed) - real_logits
        logits_idx += [pad] * extra
    batch.logits_idx = long_tensor(logits_idx)
    if w == 0:
        batch.full = _full_attention_meta(layout, chunks, tokens, padding)
    return _tensor(positions), batch


def _kv_rows(table: list[int], end: int, bs: int) -> np.ndarray:
    """Pool rows of positions 0 .. end-1 of a sequence with block table ``table``."""
    blocks = np.asarray(table[: (end + bs - 1) // bs], dtype=np.int64)
    return (blocks[:, None] * bs + np.arange(bs)).ravel()[:end]


def _full_attention_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    tokens: _TokenLayout,
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
        n_decode = _padded_len(len(decode), len(chunks) if fixed_len is not None else None)
        decode += [-1] * (n_decode - len(decode))
        spans += [[0, 0, 0, 0]] * (_padded_len(len(spans), None) - len(spans))
        span_rows.append(np.full(_padded_len(offset, None) - offset, null_row, dtype=np.int64))
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
        _tensor(rows),
        _tensor(kv),
        _tensor(valid),
        _tensor(np.asarray(spans, dtype=np.int64).reshape(-1, 4)),  # stays on the CPU: read by the host
        _tensor(np.concatenate(span_rows) if span_rows else np.zeros(0, dtype=np.int64)),
    )
