"""The step-metadata builder: turns one step's chunks (which positions of which sequences
run, and where their blocks are) into a ``ForwardBatch`` of index tensors, so the layers do
only gathers, math and scatters. ``StepPadding`` keeps the tensor shapes independent of the
step's contents for compiled steps and captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    # window-pool block of each of ``block_table``'s blocks (a bounded window; blocks out of
    # the window point at the window pool's null block); None: the window sits in block_table
    window_table: list[int] | None = None


@dataclass
class _TokenLayout:
    """Per-token facts of a step, shared by every ratio's bookkeeping."""

    positions: torch.Tensor  # [T]
    token_block: torch.Tensor  # [T, max_blocks] each token's block table
    window_block: torch.Tensor  # [T, max_blocks] its window blocks (token_block unless bounded)
    slot: torch.Tensor  # [T]
    end: torch.Tensor  # [T] end position (exclusive) of the token's chunk
    base: list[int]  # first token row of each chunk


# A compressor row a step reads (its kv and gate projections), as one int: lists of them are
# built for every group a prefill closes, and plain ints cost a fraction of objects there.
# >= 0: a token row of this step (projected now); -(2p + 1): row p of the slot's open-group
# buffer pool; -(2p + 2): row p of its overlap pool (a copy of its last closed group).
PADDING_ROW = 0  # what padded entries point at (outputs discarded)


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
    return values + [fill] * (_padded_len(len(values), bound) - len(values))


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
    n = _padded_len(len(groups.members), per_group)
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


def _group_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    ratio: int,
    tokens: _TokenLayout,
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
        extra = _padded_len(buf_src.shape[0], t_total if fixed else None) - buf_src.shape[0]
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
    moved = batch.map_metadata(lambda t: to_device(t, device), keep_on_host=("span_meta",))
    return to_device(positions, device), moved


def _build_on_host(
    layout: CacheLayout,
    pools: list[LayerPools],
    chunks: list[SeqChunk],
    padding: StepPadding | None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """``build_forward_batch``'s work; every tensor is made on the host (CPU)."""
    bs, w = layout.block_size, layout.window
    if padding is not None:
        real = sum(c.num_tokens for c in chunks)
        target = _padded_len(real, padding.num_tokens)
        null_window = None if padding.null_window_block is None else [padding.null_window_block]
        null = SeqChunk([padding.null_block], padding.null_slot, 0, 1, window_table=null_window)
        chunks = chunks + [null] * (target - real)
    lengths = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    first_row = torch.cumsum(lengths, 0) - lengths
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
    positions = starts[seq_of_token] + torch.arange(int(lengths.sum())) - first_row[seq_of_token]
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks])
    window_tables = tables
    if any(c.window_table is not None for c in chunks):
        null_window = padding.null_window_block if padding is not None else None
        rows = []
        for c in chunks:
            table = c.window_table
            if table is None or len(table) != len(c.block_table):
                raise ValueError("a bounded window needs a window table as long as each block table")
            fill = null_window if null_window is not None else table[-1]
            rows.append(table + [fill] * (max_blocks - len(table)))
        window_tables = torch.tensor(rows, dtype=torch.long)
    slots = torch.tensor([c.slot for c in chunks], dtype=torch.long)
    tokens = _TokenLayout(
        positions=positions,
        token_block=tables[seq_of_token],
        window_block=window_tables[seq_of_token],
        slot=slots[seq_of_token],
        end=(starts + lengths)[seq_of_token],
        base=first_row.tolist(),
    )
    positions = tokens.positions

    def rows_at(q: torch.Tensor) -> torch.Tensor:
        """Window-pool rows of positions ``q`` [T, n] of each token's sequence."""
        qc = q.clamp(min=0)
        return tokens.window_block.gather(1, qc // bs) * bs + qc % bs

    window_q = positions.unsqueeze(1) - torch.arange(w)  # [T, W]
    logits_idx = [base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.logits_offsets]
    real_logits = len(logits_idx)
    feature_idx = None
    if any(c.feature_offsets is not None for c in chunks):
        rows = [
            base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.feature_offsets or ()
        ]
        if padding is not None:
            rows += [0] * (_padded_len(len(rows), None) - len(rows))
        feature_idx = torch.tensor(rows, dtype=torch.long)
    batch = ForwardBatch(
        pools=pools,
        window_idx=rows_at(window_q),
        window_valid=window_q >= 0,
        window_write=rows_at(positions.unsqueeze(1)).squeeze(1),
        logits_idx=torch.tensor(logits_idx, dtype=torch.long),
        feature_idx=feature_idx,
    )
    for ratio in layout.ratios:
        batch.groups[ratio] = _group_meta(layout, chunks, ratio, tokens, padding)
    if any(c.replay_from > 0 for c in chunks):
        replay = torch.tensor([c.replay_from for c in chunks], dtype=torch.long)[seq_of_token]
        rows = torch.nonzero(positions >= replay).squeeze(1)
        window_valid = batch.window_valid & (window_q >= replay.unsqueeze(1))
        if rows.numel() < positions.numel() or not torch.equal(window_valid, batch.window_valid):
            batch.decoder_rows, batch.decoder_window_valid = rows, window_valid
    if padding is not None:
        # extra logits rows repeat a real row's logits (callers index real rows only): the
        # first requested row, or a row that runs the decoder layers (CED skips some)
        fixed = len(chunks) if padding.max_model_len is not None else None
        pad = logits_idx[0] if logits_idx else 0
        if not logits_idx and batch.decoder_rows is not None and batch.decoder_rows.numel():
            pad = int(batch.decoder_rows[0])
        extra = _padded_len(real_logits, fixed) - real_logits
        batch.logits_idx = torch.tensor(logits_idx + [pad] * extra, dtype=torch.long)
    if w == 0:
        batch.full = _full_attention_meta(layout, chunks, tokens, padding)
    return positions, batch


def _kv_rows(table: list[int], end: int, bs: int) -> torch.Tensor:
    blocks = torch.tensor(table[: (end + bs - 1) // bs], dtype=torch.long)
    return (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:end]


def _full_attention_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    tokens: _TokenLayout,
    padding: StepPadding | None = None,
) -> FullAttentionMeta:
    """Decode rows and prefill spans. Padding adds decode rows of -1 and spans of 0 tokens,
    which ``paged_attention`` skips; padded pool rows point at the null block."""
    bs = layout.block_size
    fixed_len = padding.max_model_len if padding is not None else None
    bases = tokens.base
    decode = [base for c, base in zip(chunks, bases, strict=True) if c.num_tokens == 1]
    spans, span_rows, offset = [], [], 0
    for c, base in zip(chunks, bases, strict=True):
        if c.num_tokens > 1:
            end = c.start + c.num_tokens
            spans.append([base, c.num_tokens, c.start, offset])
            span_rows += _kv_rows(c.block_table, end, bs).tolist()
            offset += end
    if padding is not None:
        null_row = padding.null_block * bs
        n_decode = _padded_len(len(decode), len(chunks) if fixed_len is not None else None)
        decode += [-1] * (n_decode - len(decode))
        spans += [[0, 0, 0, 0]] * (_padded_len(len(spans), None) - len(spans))
        span_rows += [null_row] * (_padded_len(len(span_rows), None) - len(span_rows))
    rows = torch.tensor(decode, dtype=torch.long)
    pos = tokens.positions[rows.clamp(min=0)]  # each decode token reads positions 0 .. pos
    length = int(pos.max()) + 1 if len(decode) else 0
    if fixed_len is not None:
        length = fixed_len  # a captured graph reads max_model_len positions
    elif padding is not None:
        length = max(length, MIN_ROWS)
    q = torch.arange(length).unsqueeze(0).expand(len(decode), -1)
    valid = (q <= pos.unsqueeze(1)) & (rows >= 0).unsqueeze(1)
    qc = torch.where(valid, q, 0)
    kv = tokens.token_block[rows.clamp(min=0)].gather(1, qc // bs) * bs + qc % bs
    if padding is not None:
        kv = torch.where(valid, kv, padding.null_block * bs)
    return FullAttentionMeta(
        rows,
        kv,
        valid,
        torch.tensor(spans, dtype=torch.long).view(-1, 4),  # stays on the CPU: read by the host
        torch.tensor(span_rows, dtype=torch.long),
    )
