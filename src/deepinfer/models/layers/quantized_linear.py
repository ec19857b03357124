"""``Fp8BlockLinear``: an ``nn.Linear`` whose weight stays fp8 e4m3 with its block scales.

The loader swaps it in for a linear whose checkpoint weight is stored that way (the released
V4 format) unless the user asks to dequantize on load (``quantization="none"``), and
``quantize_linears_fp8`` swaps it in for float linears (``quantization="fp8"``). The matmul
runs ``deepinfer::fp8_block_linear`` (kernels/quantized.py), which dequantizes a tile of rows
at a time. Inference only: the fp8 weight carries no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.quantized import fp8_block_linear
from deepinfer.weights.quant import quantize_fp8_blocks


class Fp8BlockLinear(nn.Module):
    """``y = x @ dequant(weight, scale).T`` with ``weight`` [out, in] fp8 e4m3 and ``scale``
    [ceil(out / block[0]), ceil(in / block[1])] (ue8m0 or fp32, as stored)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"fp8 linear weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype}")
        expected = tuple(-(-n // b) for n, b in zip(weight.shape, block, strict=True))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"fp8 scale has shape {tuple(scale.shape)}, expected {expected} for block {block}"
            )
        self.out_features, self.in_features = weight.shape
        self.block = (int(block[0]), int(block[1]))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = fp8_block_linear(flat, self.weight, self.scale, *self.block)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks {self.block}"


def replace_linear(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where the submodule ``name`` (an ``nn.Linear``) was."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, leaf, module)


def quantize_linears_fp8(model: nn.Module, names: list[str], block: tuple[int, int]) -> None:
    """Quantize the float linears ``names`` of ``model`` to resident fp8 blocks."""
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise ValueError(f"quantization='fp8': {name} is not a bias-free linear")
        weight, scale = quantize_fp8_blocks(linear.weight.detach(), block)
        replace_linear(model, name, Fp8BlockLinear(weight, scale, block))
