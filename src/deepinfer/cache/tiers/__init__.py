"""Host and disk tiers below the paged KV pool: full prefix-cache blocks, every layer kind of
their span, kept past the pool's eviction and the process (``store.KVTiers``)."""

from deepinfer.cache.tiers.store import KVTiers, TierStats

__all__ = ["KVTiers", "TierStats"]
