"""Routed experts of a decode-sized MoE step as one CPU call (fp32).

At a few tokens per step the sorted dispatch of ``moe.routed_experts_reference`` (argsort,
bincount, a gather, three ``F.linear`` per active expert, ``index_add_``) costs ~150 us of
dispatch for microseconds of arithmetic on a small model. This kernel computes each
(token, choice) pair's SwiGLU expert as dot products against the expert's weight rows, then
each token's output as the router-weighted sum over its choices in choice order. Every dot
product runs in a fixed order that depends only on the token's own row, so a token's result
is the same whatever it is batched with (within ``MAX_ROWS``). Sums run in another order than
the GEMMs', so results agree with the reference to fp32 rounding, not bitwise.
Built once per machine by ``cpu_build``; callers keep the reference where it is missing.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build

# Tokens per call up to which the per-pair dot products beat the sorted GEMM dispatch.
MAX_ROWS = 16

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

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
    return lib


def supports(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Decode-sized fp32 CPU tokens and contiguous fp32 stacked experts, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
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
    """The ``deepinfer::routed_experts`` contract (kernels/moe.py) for ``supports`` inputs."""
    lib = _library()
    assert lib is not None
    x = x.contiguous()
    n_tok, d = x.shape
    k, inter = ids.shape[1], w1.shape[1]
    weights = weights.to(torch.float32).contiguous()
    ids = ids.to(torch.int64).contiguous()
    h = torch.empty(n_tok * k, inter)
    out = torch.empty_like(x)
    threads = torch.get_num_threads() if n_tok * k * inter * d >= 1 << 17 else 1
    lib.routed_experts_f32(
        x.data_ptr(),
        weights.data_ptr(),
        ids.data_ptr(),
        w1.data_ptr(),
        w2.data_ptr(),
        w3.data_ptr(),
        h.data_ptr(),
        out.data_ptr(),
        n_tok,
        k,
        d,
        inter,
        limit,
        threads,
    )
    return out
