"""What models and the engine share about the cache (DESIGN.md §2): each layer's needs
(``LayerCacheSpec``), the physical pools (``pools``), the per-step index tensors
(``ForwardBatch``) and their builder (``step_metadata``), and the one-shot ``Session`` behind
``model(input_ids)``. It imports nothing from ``models`` or ``engine``: both build on it."""
