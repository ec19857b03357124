"""Large CPU cache pools are anonymous memory mappings: zero from the start, resident only as
they are touched (``cache/pools._zeros``)."""

from __future__ import annotations

import torch
from memory_guard import rss_bytes as _rss
from memory_guard import trim_heap

from deepinfer.cache import pools

GIB = 1 << 30


def _settled_rss() -> int:
    """The resident size once freed heap memory is handed back: ``pool.any()`` makes a
    temporary of a quarter of the pool, which the allocator may carve from heap pages earlier
    tests freed and keep resident after it is freed (the CPU platform keeps freed heap
    memory mapped); the pool's own pages are a mapping apart, untouched by a trim."""
    trim_heap()
    return _rss()


def test_large_pools_are_zero_and_resident_only_where_touched():
    before = _settled_rss()
    pool = pools._zeros(1024, GIB // 4096, dtype=torch.float32, device="cpu")  # 1 GiB
    assert pool.shape == (1024, GIB // 4096) and pool.dtype == torch.float32
    assert _rss() - before < 64 << 20  # nothing written yet
    assert not pool.any()  # reads see zeros, and reading makes nothing resident
    assert _settled_rss() - before < 64 << 20
    pool.index_copy_(0, torch.tensor([3, 700]), torch.ones(2, pool.shape[1]))
    assert pool[3].sum().item() == pool.shape[1] and pool[700].all() and not pool[4].any()
    assert _rss() - before < 128 << 20  # only the rows touched became resident
    small = pools._zeros(4, 8, dtype=torch.bfloat16, device="cpu")
    assert not small.any() and small.dtype == torch.bfloat16


def test_the_resident_check_can_fail():
    """The measurement above sees memory that is written: a zeroed tensor of the same size
    (what ``torch.zeros`` did) is resident at once."""
    before = _rss()
    eager = torch.zeros(GIB // 4, dtype=torch.float32)
    assert _rss() - before > GIB // 2
    del eager
