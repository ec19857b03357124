"""The prefix cache's block hashes: a full block's hash covers its tokens and its parent's hash,
so equal hashes mean equal prefixes (``engine/block_pool.py`` says why SHA-256 and a salt).
The tiers and a prefill server's handover name blocks by them."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """SHA-256 of the parent hash (or, for a first block, the salt) and the block's tokens."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(b"p" + parent)
    elif salt is not None:
        h.update(b"s" + salt.encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prompt_block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The hashes of the full blocks a prefix hit of ``tokens`` may take: every full block but
    one that would hold the last token (a step must compute at least one token)."""
    hashes: list[bytes] = []
    parent = None
    for k in range((len(tokens) - 1) // block_size):
        parent = block_hash(parent, tokens[k * block_size : (k + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
