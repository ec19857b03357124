"""The compressor bookkeeping of one step (``GroupMeta``, one ratio) as one compiled C++ loop.

The NumPy builder (``group_meta.build_numpy``) spends ~60 small array operations per
ratio, a fixed cost whatever the batch (a one-row decode step pays it too, twice for the tiny
V4's two ratios). Here the same walk runs in C++ over the step's token
layout: a first call computes every field into per-thread scratch and returns the padded
sizes, the caller allocates exact tensors, a second call copies into them. Built once per
machine from ``kernels/cpu/group_meta.cpp`` by ``cpu.build`` (Inductor's compiler driver); where no compiler exists, ``available``
is False and the NumPy builder runs. Both are tested equal to the Python walk they replaced
(``tests/support/step_metadata_reference.py``)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from deepinfer.kernels.cpu import build as cpu_build

# GroupMeta's int64 fields in the order ``group_meta_copy`` writes them.
FIELDS = (
    "src_buf_rows",
    "src_ovl_rows",
    "group_rows",
    "prev_rows",
    "group_pos",
    "entry_slot",
    "buf_src",
    "buf_dst",
    "ovl_src",
    "ovl_dst",
    "snap_src",
    "snap_dst",
    "restore_src",
    "restore_dst",
    "entry_idx",
)

_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = cpu_build.load(cpu_build.source("group_meta.cpp"))
    if lib is not None:
        lib.group_meta_build.argtypes = [_P] * 6 + [_I, _I, _P, _P] + [_I] * 8 + [_P]
        lib.group_meta_build.restype = _I
        cpu_build.bind(lib, "group_meta_copy", [_P, _P])
    return lib


def available() -> bool:
    """Whether the compiled builder loaded (a C++ compiler exists on this machine)."""
    return library() is not None


def _int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def build(
    block_size: int,
    ratio: int,
    tokens,
    padding,
    min_rows: int,
) -> dict[str, torch.Tensor] | None:
    """GroupMeta's fields as tensors for one ratio, or None where this builder does not
    apply (a padded size too small for the step, an empty block table): the caller's NumPy
    builder then runs, and raises its error where there is one.

    ``tokens``: ``token_layout.TokenLayout``; ``padding``: its ``StepPadding`` or None;
    ``min_rows``: ``step_chunks.MIN_ROWS``."""
    lib = library()
    assert lib is not None
    t_total = int(tokens.positions.shape[0])
    tables = _int64(tokens.tables)
    if tables.ndim != 2 or tables.shape[1] == 0 or block_size % ratio:
        return None
    starts, ends, slots, bases = (
        _int64(a) for a in (tokens.chunk_start, tokens.chunk_end, tokens.chunk_slot, tokens.chunk_base)
    )
    restore = np.ascontiguousarray(tokens.chunk_restore, dtype=np.bool_)
    positions, seq_of_token = _int64(tokens.positions), _int64(tokens.seq_of_token)
    sizes = np.empty(8, dtype=np.int64)
    padded = padding is not None
    max_len = padding.max_model_len if padded and padding.max_model_len is not None else -1
    status = lib.group_meta_build(
        starts.ctypes.data,
        ends.ctypes.data,
        slots.ctypes.data,
        bases.ctypes.data,
        restore.ctypes.data,
        tables.ctypes.data,
        tables.shape[0],
        tables.shape[1],
        positions.ctypes.data,
        seq_of_token.ctypes.data,
        t_total,
        block_size,
        ratio,
        int(padded),
        max_len,
        padding.null_slot if padded else 0,
        padding.null_block if padded else 0,
        min_rows,
        sizes.ctypes.data,
    )
    if status != 0:
        return None
    groups, buffers, overlaps, open_rows, copies, snaps, restores, entries = sizes.tolist()
    shapes = (
        (buffers,),
        (overlaps,),
        (groups, ratio),
        (groups, ratio),
        (groups,),
        (groups,),
        (open_rows,),
        (open_rows,),
        (copies,),
        (copies,),
        (snaps,),
        (snaps,),
        (restores,),
        (restores,),
        (t_total, entries),
    )
    # sizes as separate arguments: torch's argument parser takes them faster than a tuple
    out = {name: torch.empty(*shape, dtype=torch.long) for name, shape in zip(FIELDS, shapes, strict=True)}
    out["entry_valid"] = torch.empty(t_total, entries, dtype=torch.bool)
    pointers = (ctypes.c_void_p * len(FIELDS))(*(out[name].data_ptr() for name in FIELDS))
    lib.group_meta_copy(pointers, out["entry_valid"].data_ptr())
    return out
