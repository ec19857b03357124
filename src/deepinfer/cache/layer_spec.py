"""What a model keeps per layer; the cache manager allocates from this alone
(docs/architecture.md, 'The cache')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's cache needs.

    ``window``: K=V vectors of ``kv_dim`` kept per token and read for the last ``window``
    positions (0: full attention over every position). ``separate_values``: V is stored
    apart from K (``kv_dim`` wide too), as dense decoders need. ``ratio``: one compressed entry per
    ``ratio`` tokens (0: none), produced from ``compressor_width``-wide projections that wait in
    a per-sequence buffer; ``overlap``: the compressor also reads the previous group.
    ``index_dim``: indexer key width (0: no indexer keys), from an ``index_width`` compressor
    (0: the keys are derived from the main compressor's latent, as in V4.1).
    ``shared_from``: the layer whose compressed entries and index keys this layer reads instead
    of keeping its own (V4.1's KV sharing); such a layer owns no compressor state either.
    ``token_ids``: one int64 per token (V4.1 keeps each token's Engram-compressed id here, the
    n-gram history of later tokens). ``window_format`` / ``entry_format`` / ``index_format``:
    the format every value of those rows already has (None: any value).
    """

    window: int
    kv_dim: int
    separate_values: bool = False
    ratio: int = 0
    overlap: bool = False
    compressor_width: int = 0
    index_dim: int = 0
    index_width: int = 0
    shared_from: int | None = None
    token_ids: bool = False
    # The trained-precision formats the model writes these rows in (QAT fake-quant on;
    # ``cache/kv_formats.py``): with ``kv_cache_dtype="auto"`` the pools store them packed
    window_format: str | None = None
    entry_format: str | None = None
    index_format: str | None = None
