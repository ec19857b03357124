"""When a layer calls its fused op instead of its plain form.

The fused ops (``deepinfer::rms_norm``, ``hc_pre``, ``moe_gate``, ``interleaved_rope``,
``compress_groups``, ``fake_quant``, ...) are one launch each on CUDA where the plain form is
several; their default implementation is the plain form itself. A layer calls the op on an
eager step off the CPU; CPU steps keep their own kernels, compiled steps the plain form
(Inductor fuses it), autograd the plain form (the ops have no backward), and
``batch_invariant`` steps the plain form (their products run on the row-invariant kernel).
"""

from __future__ import annotations

import torch

from deepinfer.kernels import batch_invariant


def runs_fused(*tensors: torch.Tensor | None) -> bool:
    """Whether a layer call over ``tensors`` (the first its activation) runs its fused op."""
    first = tensors[0]
    assert first is not None
    if first.device.type == "cpu" or torch.compiler.is_compiling() or batch_invariant.active():
        return False
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)
