"""Paged cache: physical pools sized from ``model.cache_spec()`` and the per-step index
tensors (``ForwardBatch``) that tell the layers where each token's rows live.

A block covers ``block_size`` tokens, a multiple of every compression ratio, so each block
holds whole compressed groups and a block boundary is a group boundary (prefix caching
needs no partial-group state). Per block and layer: the window K=V vectors of its tokens,
its compressed entries and indexer keys, and (CSA) a snapshot of the compressor overlap at
the block's end. Per sequence *slot*: the compressors' partial-group buffers and live overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deepinfer.models.cache_spec import LayerCacheSpec
from deepinfer.models.forward_batch import (
    CompressorPools,
    ForwardBatch,
    FullAttentionMeta,
    GroupMeta,
    LayerPools,
)


@dataclass(frozen=True)
class CacheLayout:
    """Block geometry shared by the cache manager and the batch builder."""

    specs: tuple[LayerCacheSpec, ...]
    block_size: int
    window: int
    ratios: tuple[int, ...]  # distinct compression ratios, ascending

    @classmethod
    def from_specs(cls, specs: list[LayerCacheSpec], block_size: int) -> CacheLayout:
        ratios = tuple(sorted({s.ratio for s in specs if s.ratio}))
        unit = math.lcm(*ratios) if ratios else 1
        rounded = math.ceil(block_size / unit) * unit
        windows = {s.window for s in specs}
        if len(windows) != 1:
            raise ValueError(f"every layer must share one window size, got {sorted(windows)}")
        return cls(tuple(specs), rounded, windows.pop(), ratios)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers (window, entries, keys, snapshots)."""
        elems = fp32_elems = 0
        for s in self.specs:
            elems += self.block_size * s.kv_dim * (2 if s.separate_values else 1)
            if s.ratio and s.shared_from is None:
                per = self.block_size // s.ratio
                elems += per * (s.kv_dim + s.index_dim)
                if s.overlap:  # overlap snapshots, fp32
                    fp32_elems += 2 * s.ratio * (s.compressor_width + s.index_width)
        token_bytes = sum(self.block_size * 8 for s in self.specs if s.token_ids)
        return elems * torch.empty(0, dtype=dtype).element_size() + fp32_elems * 4 + token_bytes

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one sequence slot costs (partial-group buffers and live overlap)."""
        elems = 0
        for s in self.specs:
            if s.ratio and s.shared_from is None:
                copies = 2 if s.overlap else 1
                elems += copies * 2 * s.ratio * (s.compressor_width + s.index_width)
        return elems * 4  # compressor state is fp32


def _compressor_pools(
    ratio: int, width: int, overlap: bool, num_blocks: int, num_slots: int, dtype: torch.dtype, device
) -> CompressorPools:
    def zeros(rows: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=dtype, device=device)

    pools = CompressorPools(buf_kv=zeros(num_slots * ratio), buf_gate=zeros(num_slots * ratio))
    if overlap:
        pools.ovl_kv, pools.ovl_gate = zeros(num_slots * ratio), zeros(num_slots * ratio)
        pools.snap_kv, pools.snap_gate = zeros(num_blocks * ratio), zeros(num_blocks * ratio)
    return pools


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


def allocate_pools(
    layout: CacheLayout, num_blocks: int, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[LayerPools]:
    """Physical pools for ``num_blocks`` blocks and ``num_slots`` sequences, plus one null
    block (id ``num_blocks``) and one null slot (id ``num_slots``) for padded rows.

    Every pool starts zeroed: masked rows are still gathered (a masked score is zeroed, and
    ``0 * NaN`` would poison the sum), and some masked rows were never written by their
    sequence (V4.1's CED prefill skips the decoder layers' window rows before the replay);
    a row left by an earlier owner of the block is finite. Compressor state stays fp32 (V4.1
    pools in fp32, and a group split across steps must not round half of itself).
    """
    for i, spec in enumerate(layout.specs):
        src = spec.shared_from
        owner = layout.specs[src] if src is not None and 0 <= src < i else None
        if src is not None and (owner is None or owner.shared_from is not None or owner.ratio != spec.ratio):
            raise ValueError(f"cache_spec: layer {i} shares the entries of layer {src}, not an earlier owner")
    pools: list[LayerPools] = []
    bs = layout.block_size
    num_blocks, num_slots = num_blocks + 1, num_slots + 1  # + the null block and slot
    for s in layout.specs:
        layer = LayerPools(window=torch.zeros(num_blocks * bs, s.kv_dim, dtype=dtype, device=device))
        if s.separate_values:
            layer.values = torch.zeros(num_blocks * bs, s.kv_dim, dtype=dtype, device=device)
        if s.token_ids:
            layer.token_ids = torch.zeros(num_blocks * bs, dtype=torch.long, device=device)
        if s.ratio and s.shared_from is not None:
            source = pools[s.shared_from]
            layer.entries, layer.index_keys = source.entries, source.index_keys
        elif s.ratio:
            entries = num_blocks * (bs // s.ratio)
            layer.entries = torch.zeros(entries, s.kv_dim, dtype=dtype, device=device)
            layer.compressor = _compressor_pools(
                s.ratio, s.compressor_width, s.overlap, num_blocks, num_slots, torch.float32, device
            )
            if s.index_dim:
                layer.index_keys = torch.zeros(entries, s.index_dim, dtype=dtype, device=device)
            if s.index_width:
                layer.indexer = _compressor_pools(
                    s.ratio, s.index_width, True, num_blocks, num_slots, torch.float32, device
                )
        pools.append(layer)
    return pools


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


Row = tuple[str, int]  # ("c", chunk row) | ("b", buffer-pool row) | ("o", overlap-pool row)


@dataclass
class _TokenLayout:
    """Per-token facts of a step, shared by every ratio's bookkeeping."""

    positions: torch.Tensor  # [T]
    token_block: torch.Tensor  # [T, max_blocks] each token's block table
    slot: torch.Tensor  # [T]
    end: torch.Tensor  # [T] end position (exclusive) of the token's chunk
    base: list[int]  # first token row of each chunk


def _row(q: int, c: SeqChunk, base: int, ratio: int) -> Row:
    """Where position q's projections are this step: chunk, buffer or overlap pool."""
    if q >= c.start:
        return ("c", base + q - c.start)
    group_start = (c.start // ratio) * ratio
    return ("b" if q >= group_start else "o", c.slot * ratio + q % ratio)


def _group_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    ratio: int,
    tokens: _TokenLayout,
    device: torch.device,
    padding: StepPadding | None,
) -> GroupMeta:
    """Compressor bookkeeping for one ratio (see ``GroupMeta``).

    Per-token work (the trailing partial group) is vectorised; Python loops only over the
    groups that close this step and the sequences restoring a prefix-cache snapshot.
    """
    bs, r = layout.block_size, ratio
    epb = bs // r
    group_rows: list[list[Row]] = []
    prev_rows: list[list[Row] | None] = []
    group_pos, entry_slot, ovl_src, ovl_dst = [], [], [], []
    snap_src, snap_dst, restore_src, restore_dst = [], [], [], []
    for c, base in zip(chunks, tokens.base, strict=True):
        s, e = c.start, c.start + c.num_tokens
        if c.restore_overlap and s > 0:
            block = c.block_table[s // bs - 1]
            restore_src += range(block * r, block * r + r)
            restore_dst += range(c.slot * r, c.slot * r + r)
        if e // r == s // r:
            continue  # no group closes: the common decode case
        for j in range(s // r, e // r):
            rows = [_row(q, c, base, r) for q in range(j * r, (j + 1) * r)]
            group_rows.append(rows)
            prev_rows.append([_row(q, c, base, r) for q in range((j - 1) * r, j * r)] if j > 0 else None)
            group_pos.append(j * r)
            entry_slot.append(c.block_table[j // epb] * epb + j % epb)
            if ((j + 1) * r) % bs == 0:  # this group ends a block: snapshot the overlap there
                snap_src += rows
                block = c.block_table[((j + 1) * r - 1) // bs]
                snap_dst += range(block * r, block * r + r)
        ovl_src += group_rows[-1]  # the last closed group becomes the sequence's overlap
        ovl_dst += range(c.slot * r, c.slot * r + r)

    t_total = int(tokens.positions.shape[0])
    all_rows = [x for g in group_rows for x in g] + [x for g in prev_rows if g for x in g]
    all_rows += ovl_src + snap_src
    buf_pool = sorted({i for kind, i in all_rows if kind == "b"})
    ovl_pool = sorted({i for kind, i in all_rows if kind == "o"})

    pos = tokens.positions
    in_tail = pos >= (tokens.end // r) * r  # tokens of each chunk's new trailing partial group
    buf_src = torch.nonzero(in_tail).squeeze(1)
    buf_dst = tokens.slot[buf_src] * r + pos[buf_src] % r
    visible = (pos + 1) // r  # entries each token may read
    e_max = int(visible.max()) if visible.numel() else 0

    if padding is not None:  # pad every list with rows of the null block / slot
        fixed = padding.max_model_len is not None
        flat = t_total * r if fixed else None  # bound of a decode step's per-row lists
        per_token = t_total if fixed else None
        null_slot_row, null_snap_row = padding.null_slot * r, padding.null_block * r

        def pad(values: list, fill, bound: int | None) -> list:
            return values + [fill] * (_padded_len(len(values), bound) - len(values))

        buf_pool = pad(buf_pool, null_slot_row, flat)
        ovl_pool = pad(ovl_pool, null_slot_row, flat)
        n_groups = _padded_len(len(group_rows), per_token)
        group_rows += [[("c", 0)] * r] * (n_groups - len(group_rows))
        prev_rows += [None] * (n_groups - len(prev_rows))
        group_pos = pad(group_pos, 0, per_token)
        entry_slot = pad(entry_slot, padding.null_block * epb, per_token)
        ovl_src, ovl_dst = pad(ovl_src, ("c", 0), flat), pad(ovl_dst, null_slot_row, flat)
        snap_src, snap_dst = pad(snap_src, ("c", 0), flat), pad(snap_dst, null_snap_row, flat)
        restore_src = pad(restore_src, null_snap_row, flat)
        restore_dst = pad(restore_dst, null_slot_row, flat)
        extra = _padded_len(buf_src.shape[0], per_token) - buf_src.shape[0]
        buf_src = torch.cat([buf_src, buf_src.new_zeros(extra)])
        buf_dst = torch.cat([buf_dst, buf_dst.new_full((extra,), null_slot_row)])
        e_max = padding.max_model_len // r if fixed else max(e_max, MIN_ROWS)

    offset = {"b": {p: t_total + k for k, p in enumerate(buf_pool)}}
    offset["o"] = {p: t_total + len(buf_pool) + k for k, p in enumerate(ovl_pool)}

    def resolve(rows: list[Row]) -> list[int]:
        return [i if kind == "c" else offset[kind][i] for kind, i in rows]

    def long(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    j = torch.arange(e_max, device=device)
    block_col = (j // epb).clamp(max=tokens.token_block.shape[1] - 1).expand(len(pos), -1)
    entry_valid = j.unsqueeze(0) < visible.unsqueeze(1)
    entry_idx = tokens.token_block.gather(1, block_col) * epb + j % epb
    if padding is not None:  # entries past a sequence's table point at the null block
        entry_idx = torch.where(entry_valid, entry_idx, padding.null_block * epb)
    return GroupMeta(
        src_buf_rows=long(buf_pool),
        src_ovl_rows=long(ovl_pool),
        group_rows=long([resolve(g) for g in group_rows]).view(-1, r),
        prev_rows=long([resolve(g) if g else [-1] * r for g in prev_rows]).view(-1, r),
        group_pos=long(group_pos),
        entry_slot=long(entry_slot),
        buf_src=buf_src,
        buf_dst=buf_dst,
        ovl_src=long(resolve(ovl_src)),
        ovl_dst=long(ovl_dst),
        snap_src=long(resolve(snap_src)),
        snap_dst=long(snap_dst),
        restore_src=long(restore_src),
        restore_dst=long(restore_dst),
        entry_idx=entry_idx,
        entry_valid=entry_valid,
    )


HOST = torch.device("cpu")


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
    device = HOST
    bs, w = layout.block_size, layout.window
    if padding is not None:
        real = sum(c.num_tokens for c in chunks)
        target = _padded_len(real, padding.num_tokens)
        null = SeqChunk([padding.null_block], padding.null_slot, 0, 1)
        chunks = chunks + [null] * (target - real)
    lengths = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    first_row = torch.cumsum(lengths, 0) - lengths
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
    positions = starts[seq_of_token] + torch.arange(int(lengths.sum())) - first_row[seq_of_token]
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks])
    slots = torch.tensor([c.slot for c in chunks], dtype=torch.long)
    tokens = _TokenLayout(
        positions=positions,
        token_block=tables[seq_of_token],
        slot=slots[seq_of_token],
        end=(starts + lengths)[seq_of_token],
        base=first_row.tolist(),
    )
    positions = tokens.positions

    def rows_at(q: torch.Tensor) -> torch.Tensor:
        qc = q.clamp(min=0)
        return tokens.token_block.gather(1, qc // bs) * bs + qc % bs

    window_q = positions.unsqueeze(1) - torch.arange(w, device=device)  # [T, W]
    logits_idx = [base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.logits_offsets]
    if padding is not None:  # extra rows return row 0's logits again; callers index real rows
        fixed = len(chunks) if padding.max_model_len is not None else None
        logits_idx += [0] * (_padded_len(len(logits_idx), fixed) - len(logits_idx))
    feature_idx = None
    if any(c.feature_offsets is not None for c in chunks):
        rows = [
            base + k for c, base in zip(chunks, tokens.base, strict=True) for k in c.feature_offsets or ()
        ]
        if padding is not None:
            rows += [0] * (_padded_len(len(rows), None) - len(rows))
        feature_idx = torch.tensor(rows, dtype=torch.long, device=device)
    batch = ForwardBatch(
        pools=pools,
        window_idx=rows_at(window_q),
        window_valid=window_q >= 0,
        window_write=rows_at(positions.unsqueeze(1)).squeeze(1),
        logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=device),
        feature_idx=feature_idx,
    )
    for ratio in layout.ratios:
        batch.groups[ratio] = _group_meta(layout, chunks, ratio, tokens, device, padding)
    if any(c.replay_from > 0 for c in chunks):
        replay = torch.tensor([c.replay_from for c in chunks], dtype=torch.long)[seq_of_token]
        rows = torch.nonzero(positions >= replay).squeeze(1)
        window_valid = batch.window_valid & (window_q >= replay.unsqueeze(1))
        if rows.numel() < positions.numel() or not torch.equal(window_valid, batch.window_valid):
            batch.decoder_rows, batch.decoder_window_valid = rows, window_valid
    if w == 0:
        batch.full = _full_attention_meta(layout, chunks, tokens, device, padding)
    return positions, batch


def _kv_rows(table: list[int], end: int, bs: int) -> torch.Tensor:
    blocks = torch.tensor(table[: (end + bs - 1) // bs], dtype=torch.long)
    return (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:end]


def _full_attention_meta(
    layout: CacheLayout,
    chunks: list[SeqChunk],
    tokens: _TokenLayout,
    device: torch.device,
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
    rows = torch.tensor(decode, dtype=torch.long, device=device)
    pos = tokens.positions[rows.clamp(min=0)]  # each decode token reads positions 0 .. pos
    length = int(pos.max()) + 1 if len(decode) else 0
    if fixed_len is not None:
        length = fixed_len  # a captured graph reads max_model_len positions
    elif padding is not None:
        length = max(length, MIN_ROWS)
    q = torch.arange(length, device=device).unsqueeze(0).expand(len(decode), -1)
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
        torch.tensor(span_rows, dtype=torch.long, device=device),
    )
