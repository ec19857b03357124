"""The V4/V4.1 attention core reading its keys from the cache pools by row:
``deepinfer::sink_attention_rows``.

``attention_with_sink`` (models/layers/attention.py) attends over parts the model gathers
first, ``pool[idx]`` [T, L, D] each (the window's rows, the compressed entries the indexer
picked or every closed group's). Under ``torch.compile`` on the CPU, Inductor fuses each
gather into the score loops, but the scores are short dot products each ending in a
horizontal sum, the softmax runs as separate passes and the value sum is a ``bmm`` of tiny
matrices: the attention cores were a sizeable share of tiny-V4 decode and prefill steps
(``torch.profiler`` with Inductor's kernel profile, benchmarks/RESULTS.md). A C++ kernel after
the gathers loses the gain to
materialising the gathered parts; this op takes the pools and row indices themselves.

The op has one or two parts (the window; the compressed entries), each a 2-D pool, row
indices [T, L] and visibility [T, L]. This module holds the formula (the Python op: gather,
then ``sink_attention``'s reference); the C++ kernel (``kernels/cpu/sink_attention_rows.cpp``)
is what ``kernels/cpu/step_ops.py`` compiles into the twin ``deepinfer::sink_attention_rows_cpu`` that
``compile_passes/row_attention.py`` puts into compiled fp32 CPU steps. The kernel does a row's
heads together: each key row is loaded once for every head's score and value sum, the softmax
(the sink included) runs in vectors over the row's keys, and the next row's key rows are
prefetched while this one computes. A row's result never depends on the other rows or the
thread count. Sums run in another order than the reference's, so results differ by rounding.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.rope import interleaved_rope
from deepinfer.kernels.sink_attention import sink_attention


def _gather(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``pool[idx]`` [*idx.shape, D] (``models/layers/gather.py``'s plain-pool gather; kept here,
    as the kernels do not import the model)."""
    return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, pool.shape[-1])


@torch.library.custom_op("deepinfer::sink_attention_rows", mutates_args=())
def sink_attention_rows(
    q: torch.Tensor,
    pool0: torch.Tensor,
    idx0: torch.Tensor,
    visible0: torch.Tensor,
    pool1: torch.Tensor | None,
    idx1: torch.Tensor | None,
    visible1: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    q_cos: torch.Tensor | None = None,
    q_sin: torch.Tensor | None = None,
    out_cos: torch.Tensor | None = None,
    out_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; pool_i [N_i, D]; idx_i, visible_i [T, L_i] (row ``idx_i[t, j]`` of
    ``pool_i`` is row t's j-th key = value); part 1 optional; sink [H]. Returns [T, H, D]:
    the softmax over every visible key and the sink, applied to the values (contiguous).
    ``q_cos``/``q_sin``: RoPE the queries first, ``out_cos``/``out_sin``: RoPE the result
    (``interleaved_rope``'s tables, e.g. [T, 1, rd / 2]; the model's de-rotation passes -sin)."""
    if q_cos is not None:
        assert q_sin is not None
        q = interleaved_rope(q, q_cos, q_sin)
    kvs, visibles = [_gather(pool0, idx0)], [visible0]
    if pool1 is not None:
        assert idx1 is not None and visible1 is not None
        kvs.append(_gather(pool1, idx1))
        visibles.append(visible1)
    out = sink_attention(q, kvs, visibles, sink, scale)
    if out_cos is not None:
        assert out_sin is not None
        out = interleaved_rope(out, out_cos, out_sin)
    return out.contiguous()


@sink_attention_rows.register_fake
def _(q, *_, **__):
    return q.new_empty(q.shape)


# T * L * H * D from which the kernel runs on every thread (below, one).
THREADED_WORK = 1 << 16
