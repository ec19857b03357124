"""A block's bytes across every pool of every layer: what a tier keeps so that a hit restores
exactly what the block held.

A block of the main pool holds, per layer, its compressed entries and indexer keys, the
compressors' overlap snapshots at its end (what a hit restores into the slot) and, unless the
window is bounded, its tokens' window K=V, values and per-token ids (V4.1's Engram history).
With a bounded window those last three live in window-pool blocks, carried as a second,
optional part under the same prefix hash. Layers that read another layer's entries (V4.1's
KV sharing) alias its tensors and are taken once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.cache.forward_batch import LayerPools
from deepinfer.cache.kv_formats import PackedRows
from deepinfer.cache.pools import CacheLayout


def _per_block(tensor: torch.Tensor | PackedRows, rows_per_block: int) -> torch.Tensor:
    """``tensor`` as bytes, one row per block: [blocks, rows_per_block * row bytes]."""
    data = tensor.data if isinstance(tensor, PackedRows) else tensor
    if not data.is_contiguous():
        raise ValueError("cache pools must be contiguous to be tiered")
    flat = data.view(torch.uint8) if data.dim() > 1 else data.view(-1, 1).view(torch.uint8)
    return flat.reshape(-1, rows_per_block * flat.shape[-1])


class BlockCodec:
    """Copies whole blocks between the pools and flat byte rows: ``gather`` reads blocks into
    a [n, bytes] uint8 tensor on the CPU, ``scatter`` writes such rows back into blocks."""

    def __init__(self, layout: CacheLayout, pools: Sequence[LayerPools]) -> None:
        bs = layout.block_size
        self.main: list[torch.Tensor] = []
        self.window: list[torch.Tensor] = []
        windowed = self.window if layout.bounded_window else self.main
        for spec, layer in zip(layout.specs, pools, strict=True):
            windowed.append(_per_block(layer.window, bs))
            if layer.values is not None:
                windowed.append(_per_block(layer.values, bs))
            if layer.token_ids is not None:
                windowed.append(_per_block(layer.token_ids, bs))
            if not spec.ratio or spec.shared_from is not None:
                continue
            assert layer.entries is not None
            self.main.append(_per_block(layer.entries, bs // spec.ratio))
            if layer.index_keys is not None:
                self.main.append(_per_block(layer.index_keys, bs // spec.ratio))
            for comp in (layer.compressor, layer.indexer):
                if comp is not None and comp.snap_kv is not None and comp.snap_gate is not None:
                    self.main += [
                        _per_block(comp.snap_kv, spec.ratio),
                        _per_block(comp.snap_gate, spec.ratio),
                    ]
        self.main_bytes = sum(f.shape[1] for f in self.main)
        self.window_bytes = sum(f.shape[1] for f in self.window)
        self.device = self.main[0].device if self.main else self.window[0].device

    @property
    def entry_bytes(self) -> int:
        """Bytes of a block with both parts."""
        return self.main_bytes + self.window_bytes

    def gather(self, blocks: Sequence[int], window_blocks: Sequence[int | None]) -> torch.Tensor:
        """[n, entry_bytes] uint8 on the CPU: the main part of ``blocks`` and the window part
        of ``window_blocks`` (one per block; None, or no bounded window: zeros)."""
        out = torch.zeros(len(blocks), self.entry_bytes, dtype=torch.uint8)
        for tensors, ids, start in (
            (self.main, list(blocks), 0),
            (self.window, list(window_blocks), self.main_bytes),
        ):
            keep = [i for i, b in enumerate(ids) if b is not None]
            if not keep or not tensors:
                continue
            index = torch.tensor([ids[i] for i in keep], dtype=torch.long, device=self.device)
            part = torch.cat([t.index_select(0, index) for t in tensors], dim=1).cpu()
            out[keep, start : start + part.shape[1]] = part
        return out

    def scatter(
        self, rows: torch.Tensor, blocks: Sequence[int | None], window_blocks: Sequence[int | None]
    ) -> None:
        """Write ``rows`` (as ``gather`` made them) back: row i's main part into ``blocks[i]``
        and its window part into ``window_blocks[i]`` (None: that part is not written)."""
        for tensors, ids, start in ((self.main, blocks, 0), (self.window, window_blocks, self.main_bytes)):
            keep = [i for i, b in enumerate(ids) if b is not None]
            if not keep or not tensors:
                continue
            src = rows[keep].to(self.device)
            index = torch.tensor([ids[i] for i in keep], dtype=torch.long, device=self.device)
            offset = start
            for t in tensors:
                width = t.shape[1]
                t.index_copy_(0, index, src[:, offset : offset + width])
                offset += width
