"""The step-metadata builder: turns one step's chunks (``step_chunks``: which positions of
which sequences run, and where their blocks are) into a ``ForwardBatch`` of index tensors, so
the layers do only gathers, math and scatters. Here the window rows, logits rows and the
replay split; the compressor groups (``group_meta``) and dense attention
(``full_attention_meta``) each have their own module, all reading one ``TokenLayout``.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch

from deepinfer.cache import full_attention_meta, group_meta
from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.cache.host_tensors import host_tensor, long_tensor, to_device_together
from deepinfer.cache.pools import CacheLayout
from deepinfer.cache.step_chunks import SeqChunk, StepPadding, padded_chunks, padded_len
from deepinfer.cache.token_layout import build_token_layout


def build_forward_batch(
    layout: CacheLayout,
    pools: list[LayerPools],
    chunks: list[SeqChunk],
    device: torch.device,
    padding: StepPadding | None = None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """Positions [T] and the ForwardBatch for a step made of ``chunks`` (in token order).

    Every index tensor is computed on the host and copied to ``device`` at the end, all of
    them in one copy per dtype (``to_device_together``), so
    the data-dependent sizes (``nonzero``, maxima) never read device memory: no device sync
    on the thread that prepares the next step. ``span_meta`` stays on the host.

    With ``padding`` the step may hold extra null tokens after the real ones (their input ids
    are the caller's to append, any valid id) and padded metadata; see ``StepPadding``."""
    positions, batch = _build_on_host(layout, pools, chunks, padding)
    if device.type == "cpu":  # already there (mapping every field would cost time every step)
        return positions, batch
    on_host: list[torch.Tensor] = [positions]
    batch.map_metadata(lambda t: on_host.append(t) or t, keep_on_host=("span_meta",))
    on_device = iter(to_device_together(on_host, device))  # one copy per dtype, in this order
    positions = next(on_device)
    return positions, batch.map_metadata(lambda _: next(on_device), keep_on_host=("span_meta",))


# chunk fields read for every chunk of a step, as C-level getters (``map`` over a step's
# chunks without a Python frame per chunk)
_FEATURE_OFFSETS = operator.attrgetter("feature_offsets")
_REPLAY_FROM = operator.attrgetter("replay_from")
_IS_NONE = functools.partial(operator.is_, None)


def _build_on_host(
    layout: CacheLayout,
    pools: list[LayerPools],
    chunks: list[SeqChunk],
    padding: StepPadding | None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """``build_forward_batch``'s work; every tensor is made on the host (CPU)."""
    bs, w = layout.block_size, layout.window
    chunks = padded_chunks(chunks, padding)
    tokens = build_token_layout(chunks, padding)
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
            rows += [0] * (padded_len(len(rows), None) - len(rows))
        feature_idx = torch.tensor(rows, dtype=torch.long)
    batch = ForwardBatch(
        pools=pools,
        window_idx=host_tensor(rows_at(window_q)),
        window_valid=host_tensor(window_valid),
        window_write=host_tensor(rows_at(positions[:, None])[:, 0]),
        logits_idx=None,  # set below, padded or not
        feature_idx=feature_idx,
    )
    for ratio in layout.ratios:
        batch.groups[ratio] = group_meta.build(layout, ratio, tokens, padding)
    if any(map(_REPLAY_FROM, chunks)):  # replay_from >= 0: some chunk replays
        replay = np.fromiter((c.replay_from for c in chunks), np.int64, len(chunks))[tokens.seq_of_token]
        rows = np.flatnonzero(positions >= replay)
        decoder_valid = window_valid & (window_q >= replay[:, None])
        if rows.size < positions.size or not np.array_equal(decoder_valid, window_valid):
            batch.decoder_rows, batch.decoder_window_valid = host_tensor(rows), host_tensor(decoder_valid)
    if padding is not None:
        # extra logits rows repeat a real row's logits (callers index real rows only): the
        # first requested row, or a row that runs the decoder layers (CED skips some)
        fixed = len(chunks) if padding.max_model_len is not None else None
        pad = logits_idx[0] if logits_idx else 0
        if not logits_idx and batch.decoder_rows is not None and batch.decoder_rows.numel():
            pad = int(batch.decoder_rows[0])
        extra = padded_len(real_logits, fixed) - real_logits
        logits_idx += [pad] * extra
    batch.logits_idx = long_tensor(logits_idx)
    if w == 0:
        batch.full = full_attention_meta.build(layout, chunks, tokens, padding)
    return host_tensor(positions), batch
