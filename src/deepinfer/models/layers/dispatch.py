"""The ops a model's layers call, each with its implementation picked per step.

A model reads as math: it calls ``add_rms_norm``, ``silu_and_mul``, ``rope_and_store`` and
``attend``. Which code runs is decided here, not in the model (the pattern of vLLM's custom
ops):
- an eager engine step on the CPU runs the C++ kernel where it supports the tensors
  (``kernels/cpu``), the plain form below to rounding (a ``batch_invariant`` step runs the
  plain form itself, so its logits are the research forward's, bitwise);
- an eager engine step on any other device runs the fused custom op (``deepinfer::rope_store``,
  ``deepinfer::add_rms_norm``, ...), whose registered CUDA kernel is one Triton launch and
  whose default is the plain form: the device choice is the dispatcher's, which is also where
  ``compile/launch_count.py`` sees it;
- a compiled step runs the custom op, which the tracer keeps opaque, or plain torch that
  Inductor fuses;
- the research binding (``ForwardBatch.functional``) runs plain torch, which autograd and
  ``functional_call`` see through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.kernels import kv_rotation, rope_triton, silu_mul_triton
from deepinfer.kernels.cpu import norm_act, rope_store
from deepinfer.kernels.paged_attention import (
    paged_attention,
    paged_attention_invariant,
    paged_attention_reference,
)
from deepinfer.models.layers.fused_ops import runs_fused
from deepinfer.models.layers.norms import RMSNorm, residual_rms_norm
from deepinfer.models.layers.rope import rotate_half_rope


def _eager_engine(batch: ForwardBatch) -> bool:
    """An engine step run eagerly: where the C++ CPU kernels may run (not under
    ``batch_invariant``, whose steps compute as the research binding's plain torch does)."""
    return not batch.functional and not batch.invariant and not torch.compiler.is_compiling()


def _device_op(batch: ForwardBatch, x: torch.Tensor) -> bool:
    """An eager engine step off the CPU, with no autograd and not ``batch_invariant`` (whose
    steps compute the plain form): where the fused ops run."""
    return _eager_engine(batch) and runs_fused(x)


def add_rms_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` (``x`` when None) and its RMSNorm, as one call where the kernel runs."""
    if _eager_engine(batch) and norm_act.supports(x):
        return norm_act.add_rms_norm(x, residual, norm.weight, norm.eps)
    if residual is None:
        return x, norm(x)
    return residual_rms_norm(norm, x, residual)


def silu_and_mul(gate_up: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``[gate, up]`` concatenated on the last dimension."""
    if _eager_engine(batch) and norm_act.supports(gate_up):
        return norm_act.silu_mul(gate_up)
    if _device_op(batch, gate_up):
        return silu_mul_triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pools: LayerPools,
    batch: ForwardBatch,
    n_heads: int,
    n_kv: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate q and k of ``qkv`` ([T, (n_heads + 2 n_kv) head_dim]: q, k, v heads side by
    side) and write k and v to the layer's pools; returns q [T, n_heads, head_dim] and the
    keys and values to attend (the pools, or under the research binding new tensors). An int8
    or fp8 cache meets q and k in its rotated basis (``kv_rotation.rotate``)."""
    assert pools.values is not None
    if _eager_engine(batch) and rope_store.supports(qkv, pools.window, pools.values):
        q = rope_store.rope_store(
            qkv, cos, sin, batch.window_write, pools.window, pools.values, n_heads, n_kv, head_dim
        )
        return q, pools.window, pools.values
    if (
        _device_op(batch, qkv)
        and isinstance(pools.window, torch.Tensor)
        and isinstance(pools.values, torch.Tensor)
        and pools.window.dtype in rope_triton.DTYPES
        and pools.values.dtype in rope_triton.DTYPES
    ):
        q = rope_triton.rope_store(
            qkv, cos, sin, batch.window_write, pools.window, pools.values, n_heads, n_kv, head_dim
        )
        return q, pools.window, pools.values
    t = qkv.shape[0]
    # q and k heads sit side by side: one RoPE call rotates both
    qk = rotate_half_rope(qkv[:, : (n_heads + n_kv) * head_dim].reshape(t, -1, head_dim), cos, sin)
    if kv_rotation.rotates(pools.window.dtype):  # keys are encoded from the rotation's fp32 values
        qk = kv_rotation.rotate(qk)
    q, k = qk[:, :n_heads].to(qkv.dtype), qk[:, n_heads:]
    v = qkv[:, (n_heads + n_kv) * head_dim :]
    keys = batch.write(pools.window, batch.window_write, k.reshape(t, -1))
    values = batch.write(pools.values, batch.window_write, v)
    return q, keys, values


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Paged attention of ``q`` over the step's full-attention metadata. Compiled steps call
    the op (opaque to the tracer); eager steps and the research binding (the op has no
    backward) call its implementation directly."""
    meta = batch.full
    assert meta is not None
    if batch.invariant:
        fn = paged_attention_invariant
    else:
        fn = paged_attention if torch.compiler.is_compiling() else paged_attention_reference
    return fn(
        q,
        keys,
        values,
        meta.decode_rows,
        meta.decode_kv,
        meta.decode_valid,
        meta.span_meta,
        meta.span_kv_rows,
    )
