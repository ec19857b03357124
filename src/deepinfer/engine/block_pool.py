"""Block allocator with prefix caching: ref counts, chained block hashes, LRU eviction.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal
prefixes. Hashes are SHA-256 (not Python's ``hash``, which is predictable and not collision
resistant: one tenant could plant blocks another's prompt would hit, as vLLM's advisory
GHSA-rm76-4mrf-v9r8 describes); a request's ``cache_salt`` seeds its first block, so only
requests with the same salt share cached blocks. A freed block keeps its hash and contents while it waits in the free queue; a
later request with the same prefix takes it back (a hit) until allocation evicts it,
least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.query_blocks = 0  # prefix-cache statistics, in blocks
        self.hit_blocks = 0
        # told of every block handed out (the KV tiers drop a copy still queued for it)
        self.on_allocate: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (evicting cached contents), or None if fewer are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self.ref_count[block] = 1
            blocks.append(block)
        if self.on_allocate is not None:
            self.on_allocate(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced ones become evictable. A block that
        caches nothing (no hash: prefix caching off, or a partial block) goes to the front of
        the free list, to be handed out first: its memory is already mapped and likely still
        in the CPU's caches, where a never-used block's pages would fault in and be zeroed on
        first write (the pools are lazily mapped), and the hashed blocks behind it keep their
        cached prefixes longer. Hashed blocks go to the back (least recently used first)."""
        for block in blocks:
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of ``hashes``; takes a reference to each."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        self.query_blocks += len(hashes)
        self.hit_blocks += len(found)
        for block in found:
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1
        return found

    def acquire(self, hashes: Sequence[bytes]) -> list[int] | None:
        """The cached blocks for exactly ``hashes``, a reference taken to each; None (and
        nothing taken) unless every one is cached. Not counted as prefix-cache queries."""
        blocks = [self._block_of.get(h) for h in hashes]
        if any(b is None for b in blocks):
            return None
        for block in blocks:
            assert block is not None
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1
        return blocks  # type: ignore[return-value]

    def cached(self, h: bytes) -> bool:
        """Whether a block is cached under ``h`` (no reference taken, not counted)."""
        return h in self._block_of

    def cache(self, block: int, h: bytes) -> None:
        """Publish a full, computed block under its prefix hash (first writer wins)."""
        if block in self._hash_of or h in self._block_of:
            return
        self._hash_of[block] = h
        self._block_of[h] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks' contents are gone); no block may be held."""
        if any(self.ref_count):
            raise RuntimeError("reset_prefix_cache: blocks are still held by requests")
        self._hash_of.clear()
        self._block_of.clear()

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0
