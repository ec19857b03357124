"""Comparing tensors that went through QAT fake-quantisation (V4.1 by default, V4 with
``fake_quant=True``): two runs that compute a value with different matrix shapes (a chunk, a
drafted step) may differ in its last bit, and a value that sits on a rounding boundary then
lands one quantisation step away. Such flips are isolated elements; a real bug (a wrong row,
a stale group) moves whole rows."""

from __future__ import annotations

import torch

MAX_FLIP_FRACTION = 0.01  # at most this share of elements may sit one step away


def assert_equal_up_to_rounding_flips(
    a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5, what: str = ""
) -> None:
    """Elements agree within ``tol`` except a few isolated ones, each at most one coarse
    grid step apart (half the larger magnitude covers one fp8 or fp4 step), and no row of
    the tensor differs in more than a quarter of its elements."""
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    if a.numel() == 0:
        return
    diff = (a.float() - b.float()).abs()
    flipped = diff > tol
    if not flipped.any():
        return
    scale = torch.maximum(a.float().abs(), b.float().abs())
    assert (diff[flipped] <= 0.5 * scale[flipped] + tol).all(), f"{what}: a value moved by more than one step"
    assert flipped.float().mean() <= MAX_FLIP_FRACTION, f"{what}: {int(flipped.sum())} elements differ"
    rows = flipped.reshape(flipped.shape[0], -1).float().mean(1) if flipped.dim() > 1 else flipped.float()
    if flipped.dim() > 1:
        assert rows.max() <= 0.25, f"{what}: a whole row differs"
