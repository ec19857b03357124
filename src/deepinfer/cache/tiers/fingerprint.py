"""What a disk tier's files are bound to: the model's weights, the cache's format and dtype.
A file written for other weights or another layout lives in another namespace and never
hits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from deepinfer.cache.pools import CacheLayout

FORMAT_VERSION = 1  # of the block payload (codec.py); bumped when its field order changes
_SAMPLE = 1 << 16  # bytes hashed at each end of a weight file


def checkpoint_fingerprint(checkpoint: Path) -> bytes:
    """The checkpoint's files as they are now: names, sizes, modification times, and the
    first and last 64 KiB of each (hashing every byte of a large model at start-up would
    cost minutes; a rewritten file changes its time, and a copied one its bytes' ends
    rarely stay put while its tensors change)."""
    h = hashlib.sha256()
    files = sorted(p for p in (checkpoint.rglob("*") if checkpoint.is_dir() else [checkpoint]) if p.is_file())
    for path in files:
        st = path.stat()
        h.update(
            f"{path.relative_to(checkpoint) if checkpoint.is_dir() else path.name}|{st.st_size}|{st.st_mtime_ns}".encode()
        )
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            if st.st_size > 2 * _SAMPLE:
                f.seek(-_SAMPLE, 2)
                h.update(f.read(_SAMPLE))
    return h.digest()


def module_fingerprint(module: torch.nn.Module) -> bytes:
    """A model with no checkpoint directory (a research or trainer's module): every
    parameter's and buffer's bytes."""
    h = hashlib.sha256()
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        data = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{data.dtype}|{tuple(data.shape)}".encode())
        h.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def namespace(model_id: bytes, layout: CacheLayout, kv_dtype: torch.dtype, entry_bytes: int) -> str:
    """The directory name of the model's blocks: weights, layout, element type, format."""
    h = hashlib.sha256(model_id)
    h.update(repr((FORMAT_VERSION, layout, str(kv_dtype), entry_bytes)).encode())
    return h.hexdigest()[:32]
