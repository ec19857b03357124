"""The step-metadata builder's compressor bookkeeping as it was first written: a plain
Python walk over every closed group, kept as the reference that the vectorised builder
(``deepinfer.cache.group_meta``) must equal field for field; and a dense step's attention
metadata (``deepinfer.cache.full_attention_meta``) as a walk over every decode row and position."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.cache.forward_batch import GroupMeta
from deepinfer.cache.pools import CacheLayout
from deepinfer.cache.step_chunks import MIN_ROWS, SeqChunk, StepPadding, padded_len

# A compressor row a step reads (its kv and gate projections), as one int: lists of them are
# built for every group a prefill closes, and plain ints cost a fraction of objects there.
# >= 0: a token row of this step (projected now); -(2p + 1): row p of the slot's open-group
# buffer pool; -(2p + 2): row p of its overlap pool (a copy of its last closed group).
PADDING_ROW = 0


def _buffer_row(p: int) -> int:
    return -2 * p - 1


def _overlap_row(p: int) -> int:
    return -2 * p - 2


def _source_of(position: int, chunk: SeqChunk, first_row: int, ratio: int) -> int:
    """Where ``position``'s projections are this step: computed now if the chunk covers it;
    else in the open group's buffer (same group as the chunk's start) or in the overlap
    copy (the group before that)."""
    if position >= chunk.start:
        return first_row + position - chunk.start
    open_group_start = (chunk.start // ratio) * ratio
    row = chunk.slot * ratio + position % ratio
    return _buffer_row(row) if position >= open_group_start else _overlap_row(row)


@dataclass
class _ClosedGroups:
    """The groups of one ratio that close in a step, and the copies that follow from them,
    as Python lists (one entry per group, or per row for the copies) of rows coded as
    ``_source_of`` returns them."""

    members: list[list[int]] = field(default_factory=list)  # each group's ratio rows
    previous: list[list[int] | None] = field(default_factory=list)  # the group before
    first_position: list[int] = field(default_factory=list)
    entry_row: list[int] = field(default_factory=list)  # entry-pool row receiving its entry
    overlap_from: list[int] = field(default_factory=list)  # a sequence's newest group ...
    overlap_to: list[int] = field(default_factory=list)  # ... becomes its overlap rows
    snapshot_from: list[int] = field(default_factory=list)  # a group ending a block ...
    snapshot_to: list[int] = field(default_factory=list)  # ... is kept as that block's snapshot
    restore_from: list[int] = field(default_factory=list)  # a prefix hit's snapshot rows ...
    restore_to: list[int] = field(default_factory=list)  # ... restored into the slot's overlap

    def pool_rows_read(self) -> tuple[list[int], list[int]]:
        """The buffer-pool and overlap-pool rows this step reads, each sorted once."""
        rows = {row for group in self.members for row in group if row < 0}
        rows.update(row for group in self.previous if group for row in group if row < 0)
        rows.update(row for row in self.overlap_from + self.snapshot_from if row < 0)
        buffer = sorted((-row - 1) // 2 for row in rows if row % 2)
        overlap = sorted((-row - 2) // 2 for row in rows if not row % 2)
        return buffer, overlap


def _closed_groups(
    layout: CacheLayout, chunks: list[SeqChunk], first_rows: list[int], ratio: int
) -> _ClosedGroups:
    """Walk the groups each chunk closes (decode steps close at most one per sequence)."""
    bs, r = layout.block_size, ratio
    entries_per_block = bs // r
    out = _ClosedGroups()
    for chunk, first_row in zip(chunks, first_rows, strict=True):
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if chunk.restore_overlap and start > 0:  # the snapshot kept with the block before start
            block = chunk.block_table[start // bs - 1]
            out.restore_from += range(block * r, (block + 1) * r)
            out.restore_to += range(chunk.slot * r, (chunk.slot + 1) * r)
        if end // r == start // r:
            continue  # no group closes: the common decode case

        def rows_of(group: int, chunk: SeqChunk = chunk, first_row: int = first_row) -> list[int]:
            low = group * r
            if low >= chunk.start:  # projected in this step: consecutive token rows
                return list(range(first_row + low - chunk.start, first_row + low - chunk.start + r))
            return [_source_of(q, chunk, first_row, r) for q in range(low, low + r)]

        for group in range(start // r, end // r):
            members = rows_of(group)
            out.members.append(members)
            out.previous.append(rows_of(group - 1) if group > 0 else None)
            out.first_position.append(group * r)
            block_of_entry = chunk.block_table[group // entries_per_block]
            out.entry_row.append(block_of_entry * entries_per_block + group % entries_per_block)
            group_end = (group + 1) * r
            if group_end % bs == 0:  # the group ends a block: snapshot the overlap there
                block = chunk.block_table[(group_end - 1) // bs]
                out.snapshot_from += members
                out.snapshot_to += range(block * r, (block + 1) * r)
        out.overlap_from += out.members[-1]
        out.overlap_to += range(chunk.slot * r, (chunk.slot + 1) * r)
    return out


def _pad_to(values: list, fill, bound: int | None) -> list:
    return values + [fill] * (padded_len(len(values), bound) - len(values))


def _pad_closed_groups(
    groups: _ClosedGroups, padding: StepPadding, ratio: int, epb: int, t_total: int
) -> None:
    """Pad every list in place with entries that touch only the null block or slot. With
    ``max_model_len`` (a captured bucket) each list takes the largest size a decode step of
    ``t_total`` tokens can need, so the shapes do not follow the step's contents."""
    fixed = padding.max_model_len is not None
    per_row = t_total * ratio if fixed else None  # rows of at most one group per token
    per_group = t_total if fixed else None
    null_slot_row, null_snapshot_row = padding.null_slot * ratio, padding.null_block * ratio
    n = padded_len(len(groups.members), per_group)
    groups.members += [[PADDING_ROW] * ratio] * (n - len(groups.members))
    groups.previous += [None] * (n - len(groups.previous))
    groups.first_position = _pad_to(groups.first_position, 0, per_group)
    groups.entry_row = _pad_to(groups.entry_row, padding.null_block * epb, per_group)
    groups.overlap_from = _pad_to(groups.overlap_from, PADDING_ROW, per_row)
    groups.overlap_to = _pad_to(groups.overlap_to, null_slot_row, per_row)
    groups.snapshot_from = _pad_to(groups.snapshot_from, PADDING_ROW, per_row)
    groups.snapshot_to = _pad_to(groups.snapshot_to, null_snapshot_row, per_row)
    groups.restore_from = _pad_to(groups.restore_from, null_snapshot_row, per_row)
    groups.restore_to = _pad_to(groups.restore_to, null_slot_row, per_row)


def reference_group_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    ratio: int,
    tokens,  # token_layout.TokenLayout
    padding: StepPadding | None,
) -> GroupMeta:
    """Compressor bookkeeping for one ratio (see ``GroupMeta``).

    Per-token work (the trailing partial group, the visible entries) is vectorised; Python
    walks only the groups that close this step and the prefix-cache restores.
    """
    r = ratio
    epb = layout.block_size // r  # entries per block
    t_total = int(tokens.positions.shape[0])
    groups = _closed_groups(layout, chunks, tokens.base, r)

    # Rows of earlier steps that this step reads, by pool.
    buffer_rows, overlap_rows = groups.pool_rows_read()

    # Tokens past their chunk's last group boundary start or extend its open group.
    pos = tokens.positions
    in_open_group = pos >= (tokens.end // r) * r
    buf_src = torch.nonzero(in_open_group).squeeze(1)
    buf_dst = tokens.slot[buf_src] * r + pos[buf_src] % r
    visible = (pos + 1) // r  # entries each token may read
    num_entries = int(visible.max()) if visible.numel() else 0

    if padding is not None:
        _pad_closed_groups(groups, padding, r, epb, t_total)
        fixed = padding.max_model_len is not None
        per_row = t_total * r if fixed else None
        buffer_rows = _pad_to(buffer_rows, padding.null_slot * r, per_row)
        overlap_rows = _pad_to(overlap_rows, padding.null_slot * r, per_row)
        extra = padded_len(buf_src.shape[0], t_total if fixed else None) - buf_src.shape[0]
        buf_src = torch.cat([buf_src, buf_src.new_zeros(extra)])
        buf_dst = torch.cat([buf_dst, buf_dst.new_full((extra,), padding.null_slot * r)])
        num_entries = padding.max_model_len // r if fixed else max(num_entries, MIN_ROWS)

    # The layers gather one "source" = cat(step rows [T], buffer_rows, overlap_rows).
    numbering = {_buffer_row(p): t_total + k for k, p in enumerate(buffer_rows)}
    numbering.update({_overlap_row(p): t_total + len(buffer_rows) + k for k, p in enumerate(overlap_rows)})

    def numbered(rows: list[int]) -> list[int]:
        return [row if row >= 0 else numbering[row] for row in rows]

    def long(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    j = torch.arange(num_entries)
    block_col = (j // epb).clamp(max=tokens.token_block.shape[1] - 1).expand(len(pos), -1)
    entry_valid = j.unsqueeze(0) < visible.unsqueeze(1)
    entry_idx = tokens.token_block.gather(1, block_col) * epb + j % epb
    if padding is not None:  # entries past a sequence's table point at the null block
        entry_idx = torch.where(entry_valid, entry_idx, padding.null_block * epb)
    return GroupMeta(
        src_buf_rows=long(buffer_rows),
        src_ovl_rows=long(overlap_rows),
        group_rows=long([numbered(g) for g in groups.members]).view(-1, r),
        prev_rows=long([numbered(g) if g else [-1] * r for g in groups.previous]).view(-1, r),
        group_pos=long(groups.first_position),
        entry_slot=long(groups.entry_row),
        buf_src=buf_src,
        buf_dst=buf_dst,
        ovl_src=long(numbered(groups.overlap_from)),
        ovl_dst=long(groups.overlap_to),
        snap_src=long(numbered(groups.snapshot_from)),
        snap_dst=long(groups.snapshot_to),
        restore_src=long(groups.restore_from),
        restore_dst=long(groups.restore_to),
        entry_idx=entry_idx,
        entry_valid=entry_valid,
    )


def reference_full_attention_meta(
    block_size: int, chunks: list[SeqChunk], padding: StepPadding | None
) -> dict[str, list]:
    """A dense (Llama) step's attention metadata (``FullAttentionMeta``) as nested lists, one
    row and one position at a time, from the step's chunks (padding chunks included).

    Decode rows: a one-token chunk's row; with padding, rows of -1 up to the padded count.
    Each reads positions 0 .. its position through its block table; positions past it are
    invalid and point at the chunk's first pool row (the null block's with padding). Spans:
    [first row, tokens, start, offset of its pool rows], and the pool rows of positions
    0 .. end - 1 of each, concatenated; padded with empty spans and null rows."""
    bs = block_size
    fixed = padding.max_model_len if padding is not None else None
    decode, spans, span_rows, row, offset = [], [], [], 0, 0
    for c in chunks:
        if c.num_tokens == 1:
            decode.append((row, c))
        else:
            end = c.start + c.num_tokens
            spans.append([row, c.num_tokens, c.start, offset])
            span_rows += [c.block_table[p // bs] * bs + p % bs for p in range(end)]
            offset += end
        row += c.num_tokens
    rows = [r for r, _ in decode]
    if padding is not None:
        want = padded_len(len(rows), len(chunks) if fixed is not None else None)
        rows += [-1] * (want - len(rows))
        spans += [[0, 0, 0, 0]] * (padded_len(len(spans), None) - len(spans))
        span_rows += [padding.null_block * bs] * (padded_len(len(span_rows), None) - len(span_rows))
    length = max((c.start + 1 for _, c in decode), default=0)
    if fixed is not None:
        length = fixed
    elif padding is not None:
        length = max(length, MIN_ROWS)
    kv, valid = [], []
    for i in range(len(rows)):
        c = decode[i][1] if i < len(decode) else None
        kv_row, valid_row = [], []
        for q in range(length):
            seen = c is not None and q <= c.start
            valid_row.append(seen)
            if seen:
                kv_row.append(c.block_table[q // bs] * bs + q % bs)
            elif padding is not None:
                kv_row.append(padding.null_block * bs)
            else:
                kv_row.append(c.block_table[0] * bs)
        kv.append(kv_row)
        valid.append(valid_row)
    return {
        "decode_rows": rows,
        "decode_kv": kv,
        "decode_valid": valid,
        "span_meta": spans,
        "span_kv_rows": span_rows,
    }
