"""Physical cache pools sized from ``model.cache_spec()``: the block geometry
(``CacheLayout``) and the zeroed tensors every layer reads and writes (``allocate_pools``).

A block covers ``block_size`` tokens, a multiple of every compression ratio, so each block
holds whole compressed groups and a block boundary is a group boundary (prefix caching
needs no partial-group state). Per block and layer: the window K=V vectors of its tokens,
its compressed entries and indexer keys, and (CSA) a snapshot of the compressor overlap at
the block's end. Per sequence *slot*: the compressors' partial-group buffers and live overlap.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from deepinfer.cache import kv_dtypes, kv_formats
from deepinfer.cache.forward_batch import CompressorPools, LayerPools
from deepinfer.cache.layer_spec import LayerCacheSpec


@dataclass(frozen=True)
class CacheLayout:
    """Block geometry shared by the cache manager and the batch builder."""

    specs: tuple[LayerCacheSpec, ...]
    block_size: int
    window: int
    ratios: tuple[int, ...]  # distinct compression ratios, ascending
    # Sliding-window K=V (and per-token ids) live in a pool of their own, whose blocks a
    # sequence gives back once they fall out of its window (``WindowBlocks``): a sequence holds
    # about ``window`` tokens of them whatever its length. Only for windowed layers.
    bounded_window: bool = False
    # rows whose spec names a trained-precision format are stored packed in it
    packed_kv: bool = False

    @classmethod
    def from_specs(
        cls,
        specs: list[LayerCacheSpec],
        block_size: int,
        bounded_window: bool = False,
        packed_kv: bool = False,
    ) -> CacheLayout:
        """``bounded_window``: keep the window K=V apart, bounded per sequence (ignored for
        full-attention models, whose "window" is every position). ``packed_kv``: store rows in
        their specs' formats (``kv_formats``)."""
        ratios = tuple(sorted({s.ratio for s in specs if s.ratio}))
        unit = math.lcm(*ratios) if ratios else 1
        rounded = math.ceil(block_size / unit) * unit
        windows = {s.window for s in specs}
        if len(windows) != 1:
            raise ValueError(f"every layer must share one window size, got {sorted(windows)}")
        window = windows.pop()
        return cls(tuple(specs), rounded, window, ratios, bounded_window and window > 0, packed_kv)

    def format_of(self, fmt: str | None, dim: int) -> str | None:
        """The packed format rows of ``dim`` values of a spec's ``fmt`` take (None: plain)."""
        return fmt if self.packed_kv and fmt is not None and kv_formats.fits(fmt, dim) else None

    def row_bytes(self, fmt: str | None, dim: int, dtype: torch.dtype) -> int:
        packed = self.format_of(fmt, dim)
        return (
            kv_formats.row_bytes(packed, dim)
            if packed
            else kv_dtypes.row_width(dim, dtype) * torch.empty(0, dtype=dtype).element_size()
        )

    def window_blocks_per_sequence(self) -> int:
        """Window blocks a sequence holds between steps: those covering its last
        ``window - 1`` positions and the block the next token lands in."""
        return math.ceil((self.window - 1) / self.block_size) + 1

    def window_block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one block of the window pool costs across all layers (0 when the window K=V
        sits in the main blocks)."""
        if not self.bounded_window:
            return 0
        return self._window_bytes(dtype)

    def _window_bytes(self, dtype: torch.dtype) -> int:
        rows = sum(
            self.row_bytes(s.window_format, s.kv_dim, dtype) * (2 if s.separate_values else 1)
            for s in self.specs
        )
        token_bytes = sum(8 for s in self.specs if s.token_ids)
        return self.block_size * (rows + token_bytes)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers (window unless bounded, entries, keys,
        snapshots)."""
        entry_bytes = fp32_elems = 0
        for s in self.specs:
            if s.ratio and s.shared_from is None:
                per = self.block_size // s.ratio
                entry_bytes += per * self.row_bytes(s.entry_format, s.kv_dim, dtype)
                if s.index_dim:
                    entry_bytes += per * self.row_bytes(s.index_format, s.index_dim, dtype)
                if s.overlap:  # overlap snapshots, fp32
                    fp32_elems += 2 * s.ratio * (s.compressor_width + s.index_width)
        window = 0 if self.bounded_window else self._window_bytes(dtype)
        return entry_bytes + fp32_elems * 4 + window

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one sequence slot costs (partial-group buffers and live overlap)."""
        elems = 0
        for s in self.specs:
            if s.ratio and s.shared_from is None:
                copies = 2 if s.overlap else 1
                elems += copies * 2 * s.ratio * (s.compressor_width + s.index_width)
        return elems * 4  # compressor state is fp32


_LAZY_BYTES = 1 << 20  # CPU pools at least this large are mapped lazily


def _zeros(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """A zero tensor. On the CPU a large one is an anonymous memory mapping: the kernel hands
    out zero pages as they are first touched, so a multi-GiB cache costs nothing at start-up
    (``torch.zeros`` wrote every byte, which took seconds for SmolLM2's default budget) and
    resident memory
    grows with the blocks in use."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if dev.type != "cpu" or nbytes < _LAZY_BYTES:
        return torch.zeros(*shape, dtype=dtype, device=dev)
    # private: untouched pages read as the kernel's zero page (a shared mapping would allocate
    # them on a read); the tensor keeps the mapping alive
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(*shape)


def _compressor_pools(
    ratio: int, width: int, overlap: bool, num_blocks: int, num_slots: int, dtype: torch.dtype, device
) -> CompressorPools:
    def zeros(rows: int) -> torch.Tensor:
        return _zeros(rows, width, dtype=dtype, device=device)

    pools = CompressorPools(buf_kv=zeros(num_slots * ratio), buf_gate=zeros(num_slots * ratio))
    if overlap:
        pools.ovl_kv, pools.ovl_gate = zeros(num_slots * ratio), zeros(num_slots * ratio)
        pools.snap_kv, pools.snap_gate = zeros(num_blocks * ratio), zeros(num_blocks * ratio)
    return pools


def check_pool_dtype(layout: CacheLayout, dtype: torch.dtype) -> None:
    """Refuse a K/V element type the layout's rows have no reader for: int8 only for
    full-attention layers (windowed and compressed rows are read through paths that know no
    scales). The engine and ``plan`` both ask."""
    if dtype == torch.int8 and any(s.window or s.ratio for s in layout.specs):
        raise ValueError("kv_cache_dtype='int8' is supported for full-attention models (Llama family) only")


def allocate_pools(
    layout: CacheLayout,
    num_blocks: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
    num_window_blocks: int | None = None,
) -> list[LayerPools]:
    """Physical pools for ``num_blocks`` blocks and ``num_slots`` sequences, plus one null
    block (id ``num_blocks``) and one null slot (id ``num_slots``) for padded rows. With
    ``layout.bounded_window`` the window K=V and token ids take ``num_window_blocks`` blocks
    of their own (plus a null one, id ``num_window_blocks``).

    Every pool starts zeroed: masked rows are still gathered (a masked score is zeroed, and
    ``0 * NaN`` would poison the sum), and some masked rows were never written by their
    sequence (V4.1's CED prefill skips the decoder layers' window rows before the replay);
    a row left by an earlier owner of the block is finite. Compressor state stays fp32 (V4.1
    pools in fp32, and a group split across steps must not round half of itself).
    """
    check_pool_dtype(layout, dtype)
    for i, spec in enumerate(layout.specs):
        src = spec.shared_from
        owner = layout.specs[src] if src is not None and 0 <= src < i else None
        if src is not None and (owner is None or owner.shared_from is not None or owner.ratio != spec.ratio):
            raise ValueError(f"cache_spec: layer {i} shares the entries of layer {src}, not an earlier owner")
    pools: list[LayerPools] = []
    bs = layout.block_size
    if layout.bounded_window and num_window_blocks is None:
        raise ValueError("a bounded window needs num_window_blocks")
    num_blocks, num_slots = num_blocks + 1, num_slots + 1  # + the null block and slot
    window_rows = (num_window_blocks + 1 if layout.bounded_window else num_blocks) * bs

    def rows_of(count: int, dim: int, fmt: str | None):
        packed = layout.format_of(fmt, dim)
        if packed is None:
            return _zeros(count, kv_dtypes.row_width(dim, dtype), dtype=dtype, device=device)
        return kv_formats.packed_zeros(packed, count, dim, dtype, device, _zeros)

    for s in layout.specs:
        layer = LayerPools(window=rows_of(window_rows, s.kv_dim, s.window_format))
        if s.separate_values:
            layer.values = _zeros(
                window_rows, kv_dtypes.row_width(s.kv_dim, dtype), dtype=dtype, device=device
            )
        if s.token_ids:
            layer.token_ids = _zeros(window_rows, dtype=torch.long, device=device)
        if s.ratio and s.shared_from is not None:
            source = pools[s.shared_from]
            layer.entries, layer.index_keys = source.entries, source.index_keys
        elif s.ratio:
            entries = num_blocks * (bs // s.ratio)
            layer.entries = rows_of(entries, s.kv_dim, s.entry_format)
            layer.compressor = _compressor_pools(
                s.ratio, s.compressor_width, s.overlap, num_blocks, num_slots, torch.float32, device
            )
            if s.index_dim:
                layer.index_keys = rows_of(entries, s.index_dim, s.index_format)
            if s.index_width:
                layer.indexer = _compressor_pools(
                    s.ratio, s.index_width, True, num_blocks, num_slots, torch.float32, device
                )
        pools.append(layer)
    return pools
