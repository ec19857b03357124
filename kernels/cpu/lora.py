"""The grouped LoRA product (SGMV) of a step's adapter rows as one CPU call per target.

At decode a mixed batch holds a few rows per adapter. ATen's form (a gather, a batched shrink
and expand over padded slot groups, a scatter-add) costs several dispatches per target for
little arithmetic. This kernel walks the step's groups of rows by slot, reads each slot's A and
B once per block of up to 8 rows (kept in vector registers: the block's partial sums), and adds
the term into the rows of the base output in place. The shrink sums blocks of 64 products,
then the blocks, so its rounding stays near a BLAS's; results agree with ATen's to fp32
rounding. Built once per machine by ``build``; fp32 only.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import batch_invariant
from deepinfer.kernels.cpu import build


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.load(build.source("lora.cpp"))
    if lib is not None:
        build.bind(
            lib,
            "lora_sgmv_f32",
            [ctypes.c_void_p, ctypes.c_int64]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
            + [ctypes.c_void_p] * 3
            + [ctypes.c_int64],
        )
    return lib


# groups of up to this many rows take the kernel (decode: a few rows per adapter, where ATen's
# dispatches cost most); longer ones (prefill) stay on ATen's matmuls
BLOCK_ROWS = 8


def supports(x: torch.Tensor, y: torch.Tensor) -> bool:
    """fp32 contiguous 2-D CPU rows without autograd, where the kernel built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and y.dtype == torch.float32
        and x.dim() == 2
        and y.dim() == 2
        and x.is_contiguous()
        and y.is_contiguous()
        and not x.requires_grad
        and not batch_invariant.active()
        and library() is not None
    )


class Matrices:
    """A target's slot matrices as the kernel reads them: A [L, in, n R] and each linear's
    B [L, R, out] (addresses taken once: the tensors are only ever written in place)."""

    def __init__(self, a: torch.Tensor, bs: list[torch.Tensor], rank: int) -> None:
        self.a, self.bs, self.rank = a, bs, rank
        self.pointers = (ctypes.c_void_p * len(bs))(*[b.data_ptr() for b in bs])
        self.outs = torch.tensor([b.shape[-1] for b in bs], dtype=torch.long)
        self.out_total = int(self.outs.sum())
        # the decode stack driver's fields for these matrices (``decode_stack.LoraTerms``)
        pointers = ctypes.cast(self.pointers, ctypes.c_void_p).value or 0
        self.driver_fields = [a.data_ptr(), rank, len(bs), pointers, self.outs.data_ptr(), self.out_total]

    def __reduce__(self) -> tuple:
        """Pickled as its tensors (a compiled step's cache key reads the stacks): the pointer
        array is made again from them."""
        return (Matrices, (self.a, self.bs, self.rank))


@functools.cache
def sgmv_address() -> int:
    """``lora_sgmv_f32``'s entry point, for drivers that call it from C++."""
    lib = library()
    assert lib is not None
    return ctypes.cast(lib.lora_sgmv_f32, ctypes.c_void_p).value or 0


def sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    group_slots: torch.Tensor,
    group_starts: torch.Tensor,
    matrices: Matrices,
) -> torch.Tensor:
    """``y`` plus each grouped row's term, in place: the rows ``rows[group_starts[g]:
    group_starts[g + 1]]`` use slot ``group_slots[g]`` (int64 host tensors)."""
    lib = library()
    assert lib is not None
    lib.lora_sgmv_f32(
        x.data_ptr(),
        x.shape[1],
        rows.data_ptr(),
        group_slots.data_ptr(),
        group_starts.data_ptr(),
        group_slots.shape[0],
        matrices.a.data_ptr(),
        matrices.rank,
        len(matrices.bs),
        matrices.pointers,
        matrices.outs.data_ptr(),
        y.data_ptr(),
        matrices.out_total,
    )
    return y
