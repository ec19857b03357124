"""Routed experts of a MoE step as one CPU call (fp32), for decode sizes and small experts.

At a few tokens per step the sorted dispatch of ``moe.routed_experts_reference`` (argsort,
bincount, a gather, three ``F.linear`` per active expert, ``index_add_``) costs ~150 us of
dispatch for microseconds of arithmetic on a small model. Two kernels, each giving a token's
result in a fixed order that depends only on its own row (so the same whatever it is batched
with, within the kernel's row range), each summing a token's choices in choice order:

- ``routed_experts_dot``: each (token, choice) pair's SwiGLU expert as dot products against the
  expert's weight rows; any expert size, up to ``MAX_ROWS`` tokens.
- ``routed_experts_transposed``: each pair as rows times the experts' transposed weights, one
  vector FMA over the output columns per input element (no horizontal sums); experts up to
  ``SMALL_EXPERT_BYTES`` per matrix (kept as transposed copies), up to
  ``MAX_ROWS_SMALL_EXPERTS`` tokens.

Sums run in another order than the GEMMs', so results agree with the reference to fp32
rounding, not bitwise. Built once per machine by ``cpu_build``; callers keep the reference
where it is missing."""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from deepinfer.kernels import cpu_build

# Tokens per call up to which the per-pair dot products beat the sorted GEMM dispatch.
MAX_ROWS = 16
# Expert matrices up to this size run the transposed kernel, up to this many tokens (a 256-
# sequence decode step: 275 us against the sorted dispatch's 528 us on the tiny V4's experts;
# at 2,048 tokens the dispatch's GEMMs win, 1.6 ms against 2.0 ms)
SMALL_EXPERT_BYTES = 1 << 20
MAX_ROWS_SMALL_EXPERTS = 512

# Transposed copies of small stacked experts, keyed by the stacked tensors' addresses, shapes
# and versions (an in-place write makes a new copy); a handful of models' worth at most.
_TRANSPOSED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TRANSPOSED_LIMIT = 64

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

using Vec = at::vec::Vectorized<float>;

static inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  alignas(64) float lanes[Vec::size()];
  acc.store(lanes);
  float s = 0.f;
  for (int j = 0; j < Vec::size(); ++j) s += lanes[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[0..n) += a * w[0..n) (lane-wise FMAs, then the tail): one broadcast step of a row-times-matrix
static inline void axpy(float a, const float* w, float* y, int64_t n) {
  const Vec av(a);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size())
    at::vec::fmadd(av, Vec::loadu(w + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] = std::fma(a, w[i], y[i]);
}

// Small experts, any token count: each pair's SwiGLU as rows times the transposed weights
// (w13t [E, d, 2I] = gate | up columns, w2t [E, I, d]), so every step is a vector FMA over
// the output columns and no dot product needs a horizontal sum. Tokens split across threads;
// a token's sums run in a fixed order, so its result does not depend on the batch.
extern "C" void routed_experts_small_f32(const float* x, const float* weights, const int64_t* ids,
                                         const float* w13t, const float* w2t, float* out, int64_t n_tok,
                                         int64_t k, int64_t d, int64_t inter, float limit, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> gu(2 * inter), h(inter), y(d);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_tok; ++n) {
      const float* xr = x + n * d;
      float* o = out + n * d;
      for (int64_t c = 0; c < d; ++c) o[c] = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids[n * k + j];
        std::fill(gu.begin(), gu.end(), 0.f);
        for (int64_t c = 0; c < d; ++c) axpy(xr[c], w13t + (e * d + c) * 2 * inter, gu.data(), 2 * inter);
        for (int64_t i = 0; i < inter; ++i) {
          const float g = std::fmin(gu[i], limit);
          const float u = std::fmax(std::fmin(gu[inter + i], limit), -limit);
          h[i] = g / (1.f + std::exp(-g)) * u;
        }
        std::fill(y.begin(), y.end(), 0.f);
        for (int64_t i = 0; i < inter; ++i) axpy(h[i], w2t + (e * inter + i) * d, y.data(), d);
        const float wt = weights[n * k + j];
        for (int64_t c = 0; c < d; ++c) o[c] += wt * y[c];
      }
    }
  }
}

// x [N, d], weights/ids [N, k], w1/w3 [E, I, d], w2 [E, d, I], h scratch [N * k, I], out [N, d]
extern "C" void routed_experts_f32(const float* x, const float* weights, const int64_t* ids, const float* w1,
                                   const float* w2, const float* w3, float* h, float* out, int64_t n_tok,
                                   int64_t k, int64_t d, int64_t inter, float limit, int threads) {
  const int64_t pairs = n_tok * k;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs * inter; ++q) {
      const int64_t p = q / inter, i = q % inter;
      const int64_t row = ids[p] * inter + i;
      const float* xr = x + (p / k) * d;
      const float g = std::fmin(dot(w1 + row * d, xr, d), limit);
      const float u = std::fmax(std::fmin(dot(w3 + row * d, xr, d), limit), -limit);
      h[p * inter + i] = g / (1.f + std::exp(-g)) * u;
    }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < n_tok * d; ++q) {
      const int64_t n = q / d, o = q % d;
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = n * k + j;
        acc += weights[p] * dot(w2 + (ids[p] * d + o) * inter, h + p * inter, inter);
      }
      out[q] = acc;
    }
  }
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        cpu_build.bind(
            lib,
            "routed_experts_f32",
            [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int],
        )
        cpu_build.bind(
            lib,
            "routed_experts_small_f32",
            [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int],
        )
    return lib


def small_experts(w1: torch.Tensor) -> bool:
    """Experts whose weight matrices stay in cache: the transposed kernel runs them up to
    ``MAX_ROWS_SMALL_EXPERTS`` tokens (from transposed copies made once, ``_transposed``)."""
    return w1[0].numel() * w1.element_size() <= SMALL_EXPERT_BYTES


def supports(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """fp32 CPU tokens, decode-sized or with small experts, and contiguous fp32 stacked
    experts, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and (x.shape[0] <= MAX_ROWS or (small_experts(w1) and x.shape[0] <= MAX_ROWS_SMALL_EXPERTS))
        and x.dtype == torch.float32
        and all(w.dtype == torch.float32 and w.is_contiguous() and w.dim() == 3 for w in (w1, w2, w3))
        and not x.requires_grad
        and _library() is not None
    )


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The ``deepinfer::routed_experts`` contract (kernels/moe.py) for ``supports`` inputs:
    small experts through the transposed kernel, others through the per-pair dot products."""
    if small_experts(w1) and x.shape[0] <= MAX_ROWS_SMALL_EXPERTS:
        return routed_experts_transposed(x, weights, ids, w1, w2, w3, limit)
    return routed_experts_dot(x, weights, ids, w1, w2, w3, limit)


def _launch(
    name: str,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    inter: int,
    limit: float,
    *tensors: torch.Tensor,
) -> torch.Tensor:
    """Run kernel ``name`` on (x, weights, ids, *tensors, out): the argument order both share."""
    lib = _library()
    assert lib is not None
    x = x.contiguous()
    weights, ids = weights.to(torch.float32).contiguous(), ids.to(torch.int64).contiguous()
    (n_tok, d), k = x.shape, ids.shape[1]
    out = torch.empty_like(x)
    threads = torch.get_num_threads() if n_tok * k * inter * d >= 1 << 17 else 1
    pointers = [t.data_ptr() for t in (x, weights, ids, *tensors, out)]
    getattr(lib, name)(*pointers, n_tok, k, d, inter, limit, threads)
    return out


def routed_experts_transposed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Each pair as rows times the experts' transposed weights (copies made once)."""
    return _launch("routed_experts_small_f32", x, weights, ids, w1.shape[1], limit, *_transposed(w1, w2, w3))


def routed_experts_dot(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Each pair as dot products against the experts' own weight rows (decode sizes)."""
    h = torch.empty(x.shape[0] * ids.shape[1], w1.shape[1])  # the pairs' SwiGLU activations
    return _launch("routed_experts_f32", x, weights, ids, w1.shape[1], limit, w1, w2, w3, h)


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter (inference tensors have none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _transposed(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13t [E, d, 2I] = gate | up columns, w2t [E, I, d]) for the transposed kernel. Cached
    per stacked tensor and version; an entry goes when its ``w1`` is collected, so a new tensor
    at a freed one's address never finds a stale copy."""
    key = tuple((id(w), w.data_ptr(), tuple(w.shape), _version(w)) for w in (w1, w2, w3))
    found = _TRANSPOSED.get(key)
    if found is None:
        if len(_TRANSPOSED) >= _TRANSPOSED_LIMIT:
            _TRANSPOSED.clear()
        w13t = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous()
        found = _TRANSPOSED[key] = (w13t, w2.transpose(1, 2).contiguous())
        weakref.finalize(w1, _TRANSPOSED.pop, key, None)
    return found
