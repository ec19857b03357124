"""fp8 K/V cache rows in the CPU kernels: ``fp8.h``, which the attention and cache-write kernels include
(with ``int8_rows.h`` for int8 pools).

``kv_cache_dtype="fp8"`` / ``"fp8_e5m2"`` pools hold e4m3fn / e5m2 codes (``cache/kv_dtypes.py``).
Reading widens 16 (AVX-512) or 8 (AVX2) codes at once, exactly: an e5m2 code is the top byte
of the fp16 with the same value, and an e4m3fn code's bits moved into an fp16's exponent and
mantissa fields give its value times 2^-8 (the exponent biases differ by 8; subnormal codes land
on fp16 subnormals, which the hardware conversion keeps), so one fp16 -> fp32 conversion and a
product by 256 give it; the e4m3fn NaN codes are made fp16 NaNs first. Without those vector
units, c10's scalar conversions. Writing saturates at the format's largest finite value, then
rounds to nearest even with c10's conversion: the bits ``kv_dtypes.store`` writes.
"""

from __future__ import annotations

import torch

# pool element type -> the name the kernels' entry points end with
POOL_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.int8: "i8",  # kv_cache_dtype="int8": codes and per-32 scales (int8_rows.h, kernels/kv_int8.py)
}


def reads_heads(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels read heads of ``head_dim`` from pools of ``dtype``: an int8 row's
    scales cover 32 values each, so each head must start a block."""
    return dtype in POOL_NAMES and (dtype != torch.int8 or head_dim % 32 == 0)
