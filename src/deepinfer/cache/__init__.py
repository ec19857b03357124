"""What models and the engine share about the cache (docs/architecture.md, 'The cache'): each
layer's needs (``LayerCacheSpec``), the physical pools (``pools``), the per-step index tensors
(``ForwardBatch``) and their builder (``step_metadata``), and the bindings outside the engine
(``session``): ``research_batch``, the one-shot step over throwaway pools behind
``model(input_ids)``, and ``Session``, a persistent cache for a group of sequences that advance
in lockstep. It imports nothing from ``models`` or ``engine``: both build on it."""
