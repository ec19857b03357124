"""The compressor bookkeeping of a step (``GroupMeta``), one per compression ratio: which
groups close, which rows they read, which copies follow. Built in NumPy here, or by the
compiled builder (``native_group_meta``) where it loaded; both give the same fields."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.cache import native_group_meta
from deepinfer.cache.forward_batch import GroupMeta
from deepinfer.cache.host_tensors import host_tensor
from deepinfer.cache.pools import CacheLayout
from deepinfer.cache.step_chunks import MIN_ROWS, StepPadding, padded_len
from deepinfer.cache.token_layout import TokenLayout

# A compressor row a step reads (its kv and gate projections), coded as one int so that
# every row of every closed group is one entry of an integer array:
# >= 0: a token row of this step (projected now); -(2p + 1): row p of the slot's open-group
# buffer pool; -(2p + 2): row p of its overlap pool (a copy of its last closed group).
PADDING_ROW = 0  # what padded entries point at (outputs discarded)


def _source_rows(tokens: TokenLayout, chunk: np.ndarray, group: np.ndarray, ratio: int) -> np.ndarray:
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


def _closed_groups(layout: CacheLayout, tokens: TokenLayout, ratio: int) -> _ClosedGroups:
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
    extra = padded_len(len(values), bound) - len(values)
    return np.concatenate([values, np.full(extra, fill, dtype=np.int64)]) if extra else values


def _pad_rows(rows: np.ndarray, fill: int, bound: int | None) -> np.ndarray:
    """``rows`` [G, r] with rows of ``fill`` appended up to the padded length."""
    extra = padded_len(rows.shape[0], bound) - rows.shape[0]
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


def build(
    layout: CacheLayout,
    ratio: int,
    tokens: TokenLayout,
    padding: StepPadding | None,
) -> GroupMeta:
    """Compressor bookkeeping for one ratio (see ``GroupMeta``): the compiled builder where
    it loaded (``native_group_meta``), else the NumPy one; both give the same fields."""
    if native_group_meta.available():
        fields = native_group_meta.build(layout.block_size, ratio, tokens, padding, MIN_ROWS)
        if fields is not None:
            return GroupMeta(**fields)
    return build_numpy(layout, ratio, tokens, padding)


def build_numpy(
    layout: CacheLayout,
    ratio: int,
    tokens: TokenLayout,
    padding: StepPadding | None,
) -> GroupMeta:
    """``build`` vectorised over sequences and groups in NumPy (a Python walk over
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
    tensor = host_tensor
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
