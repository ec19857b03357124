"""Interleaved partial RoPE on the trailing channels, with optional YaRN; Llama's rotate-half
RoPE (``rotate_half_rope``, defined with its kernels in ``kernels/rope.py``).

V4 rotates *adjacent* channel pairs of the last ``rope_dim`` channels of a vector. Layers with
a compressed branch use ``compress_rope_theta`` with YaRN (no mscale); sliding-only layers use
``rope_theta`` without scaling. An eager step off the CPU rotates with one op per call
(``deepinfer::interleaved_rope``, ``kernels/interleaved_rope_triton.py``); the rest keep the
plain formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.kernels import interleaved_rope_triton
from deepinfer.kernels.rope import interleaved_rope
from deepinfer.kernels.rope import rotate_half_rope as rotate_half_rope  # the layers' name for it
from deepinfer.models.layers.fused_ops import runs_fused


@dataclass
class YarnParams:
    """YaRN frequency scaling (no mscale: attention_factor is 1.0 for V4)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnParams | None) -> torch.Tensor:
    """One inverse frequency per rotated pair (``rope_dim // 2`` entries), fp32."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    base_freq = 1.0 / (theta**exponents)
    if yarn is None:
        return base_freq

    def correction_dim(rotations: float) -> float:
        orig = yarn.original_max_position_embeddings
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 = keep the original frequency, 0 = fully interpolated
    return base_freq / yarn.factor * (1.0 - keep) + base_freq * keep


class Rotary:
    """Computes ``(cos, sin)`` for absolute positions; tables are made per call, not stored,
    so the model can be built on the meta device and loaded without materialising buffers."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnParams | None) -> None:
        self.rope_dim = rope_dim
        self._inv_freq = rope_inv_freq(rope_dim, theta, yarn)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The frequencies on ``device`` (copied once per device; ``compile_step`` fills the
        copy before tracing so the compiled step never sees the table being created)."""
        inv = self._by_device.get(device)
        if inv is None:
            inv = self._by_device.setdefault(device, self._inv_freq.to(device))
        return inv

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq(positions.device)
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs of the last ``2 * cos.shape[-1]`` channels of ``x`` in fp32.

    ``cos``/``sin`` are ``[..., S, rope_dim/2]`` and broadcast against ``x``'s leading dims;
    ``inverse`` undoes the rotation (``-sin``: attention de-rotates its output at the query
    position). An eager step off the CPU runs it as one op (``deepinfer::interleaved_rope``,
    one launch on CUDA). A compiled fp32 CPU step calls it as one op (``deepinfer::rope``, the
    same formula; its C++ twin rotates whole pairs in vector lanes where Inductor's loops went
    element by element).
    """
    if runs_fused(x, cos, sin):
        return interleaved_rope_triton.rope(x, cos, sin, inverse)
    if inverse:
        sin = -sin
    if x.device.type == "cpu" and x.dtype == torch.float32 and torch.compiler.is_compiling():
        return torch.ops.deepinfer.rope(x, cos, sin)
    return interleaved_rope(x, cos, sin)
