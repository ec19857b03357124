"""Sinkhorn normalisation of the mHC stream mixer (model_spec.md §2.2).

``reference`` is the plain PyTorch definition. On CPU the same arithmetic runs as one C++
loop per matrix (built once per machine by ``cpu_build``): the matrices are tiny ([T, 4, 4])
and the 2 * iters row/column normalisations are pure per-op overhead in eager PyTorch (~10 us
each). Where no compiler is available the NumPy version runs instead (~1.5 us per
normalisation). Every path computes in fp32, matrix by matrix, so a row's result does not
depend on the batch around it.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from deepinfer.kernels import cpu_build


def reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax rows, then alternate column/row normalisation, ending on columns."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Column sums, then divide: c[i][j] /= (sum_i c[i][j] + eps).
static void normalise_columns(float* c, int64_t n, float eps, float* sums) {
  for (int64_t j = 0; j < n; ++j) sums[j] = 0.f;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) sums[j] += c[i * n + j];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sums[j] + eps;
}

static void normalise_rows(float* c, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) s += c[i * n + j];
    for (int64_t j = 0; j < n; ++j) c[i * n + j] /= s + eps;
  }
}

// Softmax of each row of one n x n matrix, then + eps (into c).
static void softmax_rows(const float* x, float* c, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float mx = x[i * n];
    for (int64_t j = 1; j < n; ++j) mx = std::fmax(mx, x[i * n + j]);
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      c[i * n + j] = std::exp(x[i * n + j] - mx);
      s += c[i * n + j];
    }
    for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / s + eps;
  }
}

// Any n: one matrix at a time.
static void sinkhorn_any(const float* logits, float* out, int64_t count, int64_t n, int64_t iters, float eps) {
  std::vector<float> sums(n);
  for (int64_t m = 0; m < count; ++m) {
    float* c = out + m * n * n;
    softmax_rows(logits + m * n * n, c, n, eps);
    normalise_columns(c, n, eps, sums.data());
    for (int64_t it = 1; it < iters; ++it) {
      normalise_rows(c, n, eps);
      normalise_columns(c, n, eps, sums.data());
    }
  }
}

// n = N known at compile time: B matrices side by side (element (i, j) of matrix b at
// c[i][j][b]), so every sum and division runs across the B matrices as one vector operation.
// Each matrix sees the same operations in the same order as in sinkhorn_any: same bits.
template <int N>
static void sinkhorn_blocked(const float* logits, float* out, int64_t count, int64_t iters, float eps) {
  constexpr int B = 16;
  alignas(64) float c[N][N][B];
  alignas(64) float one[N * N];
  for (int64_t m0 = 0; m0 < count; m0 += B) {
    const int nb = static_cast<int>(std::min<int64_t>(B, count - m0));
    for (int b = 0; b < B; ++b) {
      if (b < nb) {
        softmax_rows(logits + (m0 + b) * N * N, one, N, eps);
      } else {
        for (int k = 0; k < N * N; ++k) one[k] = 1.f;  // idle lanes: finite, never stored
      }
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) c[i][j][b] = one[i * N + j];
    }
    for (int64_t it = 0; it < iters || it == 0; ++it) {
      if (it > 0) {
        for (int i = 0; i < N; ++i) {
          float s[B];
          for (int b = 0; b < B; ++b) s[b] = 0.f;
          for (int j = 0; j < N; ++j)
            for (int b = 0; b < B; ++b) s[b] += c[i][j][b];
          for (int j = 0; j < N; ++j)
            for (int b = 0; b < B; ++b) c[i][j][b] /= s[b] + eps;
        }
      }
      float s[N][B];
      for (int j = 0; j < N; ++j)
        for (int b = 0; b < B; ++b) s[j][b] = 0.f;
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j)
          for (int b = 0; b < B; ++b) s[j][b] += c[i][j][b];
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j)
          for (int b = 0; b < B; ++b) c[i][j][b] /= s[j][b] + eps;
    }
    for (int b = 0; b < nb; ++b)
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) out[(m0 + b) * N * N + i * N + j] = c[i][j][b];
  }
}

extern "C" void sinkhorn_f32(const float* logits, float* out, int64_t count, int64_t n, int64_t iters,
                             float eps) {
  if (n == 4) {
    sinkhorn_blocked<4>(logits, out, count, iters, eps);
  } else {
    sinkhorn_any(logits, out, count, n, iters, eps);
  }
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        cpu_build.bind(lib, "sinkhorn_f32", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_float])
    return lib


def _cpp(comb: torch.Tensor, iters: int, eps: float, lib: ctypes.CDLL) -> torch.Tensor:
    n = comb.shape[-1]
    out = torch.empty_like(comb)
    lib.sinkhorn_f32(comb.data_ptr(), out.data_ptr(), comb.numel() // (n * n), n, iters, eps)
    return out


def _numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = torch.softmax(comb, dim=-1).numpy().copy()
    e = np.float32(eps)
    c += e
    c /= c.sum(axis=-2, keepdims=True) + e
    for _ in range(iters - 1):
        c /= c.sum(axis=-1, keepdims=True) + e
        c /= c.sum(axis=-2, keepdims=True) + e
    return torch.from_numpy(c)


@torch.library.custom_op("deepinfer::sinkhorn", mutates_args=())
def sinkhorn_op(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The custom op: opaque to ``torch.compile``, so the 2 * iters normalisations of every
    mHC site do not unroll into the traced graph (they are per-op overhead, not math)."""
    if comb.device.type == "cpu" and comb.dtype == torch.float32:
        comb = comb.contiguous()
        lib = _library()
        if lib is not None:
            return _cpp(comb, iters, eps, lib)
        return _numpy(comb, iters, eps)
    return reference(comb, iters, eps)


@sinkhorn_op.register_fake
def _(comb, iters, eps):
    return torch.empty_like(comb)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """fp32 [..., n, n] logits -> doubly-stochastic (up to eps) mixing matrices."""
    if comb.requires_grad:
        return reference(comb, iters, eps)
    return sinkhorn_op(comb, iters, eps)
