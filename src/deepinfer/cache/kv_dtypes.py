"""The paged K/V cache's element types (``kv_cache_dtype``, vLLM's names) and how values are
stored in them.

``"fp8"`` (= ``"fp8_e4m3"``) and ``"fp8_e5m2"`` store each value as it is, with a scale of 1
(vLLM's default when a checkpoint ships no calibrated K/V scales, and none of ours does),
rounded to nearest even and saturated at the format's largest finite value (448 / 57,344): a
value past the range is clipped, never turned into NaN or infinity. Reads widen the codes
exactly. e4m3 keeps three mantissa bits whatever the scale, so such a cache raises a model's
perplexity several times as much as llama.cpp's q8_0 cache does (benchmarks/RESULTS.md).

``"int8"`` stores int8 codes with one fp32 scale per 32 values, as llama.cpp's q8_0 does with
fp16 scales (``kernels/kv_int8.py`` defines the rows; 9 bits per value against q8_0's 8.5).

The CPU kernels (``kernels/cpu/fp8.py``) store and read the same bits as ``store`` and
``read`` here.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.kv_int8 import encode as encode_int8
from deepinfer.kernels.kv_int8 import read, row_width, values_per_row

__all__ = [
    "KV_CACHE_DTYPES",
    "pool_dtype",
    "is_fp8",
    "row_width",
    "values_per_row",
    "read",
    "to_pool",
    "store",
]

# kv_cache_dtype -> the pools' element type ("auto" is the model's choice: see EngineConfig)
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
# the largest finite value of each fp8 format (values past it are stored as it)
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def pool_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The element type of the pools for a ``kv_cache_dtype`` option ("auto": the model's
    compute dtype; its packed trained formats are decided by the cache layout)."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def to_pool(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in a pool's element type: fp8 saturated at its largest finite value (NaN
    stays NaN), others a plain cast."""
    limit = FP8_MAX.get(dtype)
    if limit is not None:
        values = values.float().clamp(-limit, limit)
    return values.to(dtype)


def store(
    pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, functional: bool = False
) -> torch.Tensor:
    """Write ``values`` at ``rows`` of ``pool`` (``index_copy_``); returns the tensor to read
    them from (the pool, or with ``functional`` a new tensor). fp8 pools are written through
    byte views: ATen's CPU ``index_copy`` has no fp8 kernel, and a byte copy of the codes is
    the same write. int8 pools store ``encode_int8``'s rows."""
    if pool.dtype == torch.int8:
        new = encode_int8(values)
        return pool.index_copy(0, rows, new) if functional else pool.index_copy_(0, rows, new)
    if not is_fp8(pool.dtype):
        values = values.to(pool.dtype)
        return pool.index_copy(0, rows, values) if functional else pool.index_copy_(0, rows, values)
    codes, new = pool.view(torch.uint8), to_pool(values, pool.dtype).view(torch.uint8)
    if functional:
        return codes.index_copy(0, rows, new).view(pool.dtype)
    codes.index_copy_(0, rows, new)
    return pool
