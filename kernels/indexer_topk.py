"""The lightning indexer's entry choice as one CPU kernel (V4 variant).

A query scores each visible compressed entry ``j`` by ``sum_h w_h * ReLU(q_h . k_j) * scale`` and
keeps the ``topk`` best, ties to the older entry (``models/layers/topk.py``). ``reference`` is
that in plain PyTorch: it gathers every entry a row may see, [T, E, D], multiplies it with
every head, [T, H, E], then masks, and under ``torch.compile`` Inductor reduces each
(token, head, entry) dot product to a scalar with a horizontal sum, for every entry up to the
batch's longest row. On the tiny V4's offline benchmark the kernel Inductor made of it (with
the layer's attention fused in) was the compiled step's largest in a ``perf`` profile
(benchmarks/RESULTS.md).

The C++ kernel reads the key rows straight from the pool, only for entries a row may see,
transposes ``V`` of them at a time (one vector of entries) and accumulates every head's
product over the head dimension as a vector of ``V`` entries: no horizontal sums and no work
for a row's padded entries. The rows of one sequence's prefill chunk see the same entries, so
a transposed block is kept for the next row, which widens the kernel's lead over the einsum
form on prefill steps. It then picks the ``topk`` with the same rule (a partial sort by
score, then column). Each row's arithmetic depends only on that row, so a token's choice
does not depend on the batch around it; its sums run in another order than ``reference``'s,
so scores differ in the last bits (the tests compare exactly on inputs whose sums are exact).

``deepinfer::indexer_topk`` is the Python custom op (the ``ctypes`` build on fp32 CPU
tensors, else ``reference``); ``kernels/cpu_step_ops.py`` registers its C++ twin for compiled
steps, built from this source."""

from __future__ import annotations

import ctypes
import functools

import torch
from deepinfer.kernels import cpu_build

_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

// Adds sum over NH heads of ReLU(q_h . k) * scale * w_h to total, for the V entries of kt
// (kt[d * V + lane]). One FMA chain over d per (head, entry), NH chains interleaved so the
// loop is bound by FMA throughput rather than one chain's latency; heads added in order.
template <int NH>
static inline at::vec::Vectorized<float> add_heads(at::vec::Vectorized<float> total, const float* q, const float* kt,
                                                   const float* w, int64_t D, float scale) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec dot[NH];
  for (int j = 0; j < NH; ++j) dot[j] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec kd = Vec::loadu(kt + d * V);
    for (int j = 0; j < NH; ++j) dot[j] = at::vec::fmadd(Vec(q[j * D + d]), kd, dot[j]);
  }
  for (int j = 0; j < NH; ++j) total = total + at::vec::maximum(dot[j], Vec(0.f)) * Vec(scale) * Vec(w[j]);
  return total;
}

// The key rows of one block of V entries, transposed into kt[d * V + lane]: a lane whose
// index is outside the pool (or past the row's E entries) holds zeros. rows: [V, D] scratch.
static void transpose_block(const float* keys, const int64_t* idx, int64_t n, int64_t D, int64_t N, float* rows,
                            float* kt) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const int64_t whole = D - D % V;
  for (int64_t l = 0; l < V; ++l) {
    const bool in_pool = l < n && idx[l] >= 0 && idx[l] < N;
    const float* src = keys + (in_pool ? idx[l] : 0) * D;
    float* dst = rows + l * D;
    if (in_pool) {
      int64_t d = 0;
      for (; d < whole; d += V) Vec::loadu(src + d).store(dst + d);
      for (; d < D; ++d) dst[d] = src[d];
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = 0.f;
    }
  }
  at::vec::transpose_mxn<float>(rows, D, kt, V, static_cast<int>(V), static_cast<int>(D));
}

// Asks for the key rows of the n entries at idx (those inside the pool) to be brought into
// the cache: the rows are scattered over the pool, so each block's copy otherwise waits on
// its loads (a 200-row decode step spent most of the kernel on them).
static inline void prefetch_rows(const float* keys, const int64_t* idx, int64_t n, int64_t D, int64_t N) {
  for (int64_t l = 0; l < n; ++l) {
    if (idx[l] < 0 || idx[l] >= N) continue;
    const char* row = reinterpret_cast<const char*>(keys + idx[l] * D);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(row + b);
  }
}

// One row t: scores of its E entries into s (-inf where not visible), then the min(K, E) best
// (score descending, column ascending) into out_rows / out_valid, and K - E padding columns
// where E < K (the row's first entry, or pool row 0 without any, never visible). Returns how many visible entries
// point outside the pool (their scores are -inf). kts [E / V blocks, D, V] holds the previous
// row's transposed blocks and cached [E] their indices: the rows of one sequence's prefill
// chunk see the same entries, so a block is transposed once per run of such rows.
static int64_t indexer_row(const float* q, const float* keys, const int64_t* idx, const bool* valid,
                           const float* w, int64_t H, int64_t D, int64_t E, int64_t N, int64_t K, float scale,
                           float* s, float* rows, float* kts, int64_t* cached, int64_t* order, int64_t* out_rows,
                           bool* out_valid) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t bad = 0;
  bool live[V];
  for (int64_t e0 = 0; e0 < E; e0 += V) {
    const int64_t n = std::min<int64_t>(V, E - e0);
    bool any = false, same = true;
    for (int64_t l = 0; l < n; ++l) {
      live[l] = valid[e0 + l] && idx[e0 + l] >= 0 && idx[e0 + l] < N;
      bad += valid[e0 + l] && !live[l];
      any |= live[l];
      same &= cached[e0 + l] == idx[e0 + l];
    }
    if (!any) {
      for (int64_t l = 0; l < n; ++l) s[e0 + l] = neg_inf;
      continue;
    }
    float* kt = kts + e0 * D;
    if (!same) {
      if (e0 + V < E) prefetch_rows(keys, idx + e0 + V, std::min<int64_t>(V, E - e0 - V), D, N);
      transpose_block(keys, idx + e0, n, D, N, rows, kt);
      for (int64_t l = 0; l < n; ++l) cached[e0 + l] = idx[e0 + l];
    }
    Vec total(0.f);
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) total = add_heads<8>(total, q + h * D, kt, w + h, D, scale);
    switch (H - h) {
      case 7: total = add_heads<7>(total, q + h * D, kt, w + h, D, scale); break;
      case 6: total = add_heads<6>(total, q + h * D, kt, w + h, D, scale); break;
      case 5: total = add_heads<5>(total, q + h * D, kt, w + h, D, scale); break;
      case 4: total = add_heads<4>(total, q + h * D, kt, w + h, D, scale); break;
      case 3: total = add_heads<3>(total, q + h * D, kt, w + h, D, scale); break;
      case 2: total = add_heads<2>(total, q + h * D, kt, w + h, D, scale); break;
      case 1: total = add_heads<1>(total, q + h * D, kt, w + h, D, scale); break;
      default: break;
    }
    float lanes[V];
    total.store(lanes);
    for (int64_t l = 0; l < n; ++l) s[e0 + l] = live[l] ? lanes[l] : neg_inf;
  }
  const int64_t k = std::min(K, E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order, order + k, order + E, [s](int64_t a, int64_t b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
  });
  for (int64_t j = 0; j < k; ++j) {
    out_rows[j] = idx[order[j]];
    out_valid[j] = valid[order[j]];
  }
  for (int64_t j = k; j < K; ++j) {
    out_rows[j] = E > 0 ? idx[0] : 0;
    out_valid[j] = false;
  }
  return bad;
}

// q [T, H, D], keys [N, D], entry_idx / entry_valid [T, E], weights [T, H]; out [T, K].
// Returns the count of visible entries outside the pool.
extern "C" int64_t indexer_topk_f32(const float* q, const float* keys, const int64_t* entry_idx,
                                    const bool* entry_valid, const float* weights, int64_t* out_rows,
                                    bool* out_valid, int64_t T, int64_t H, int64_t D, int64_t E, int64_t N,
                                    int64_t K, float scale, int threads) {
  constexpr int64_t V = at::vec::Vectorized<float>::size();
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad)
  {
    const int64_t blocks = (E + V - 1) / V;
    std::vector<float> s(E), rows(V * D), kts(blocks * V * D);
    std::vector<int64_t> order(E), cached(E, -1);  // -1: no block transposed yet (nor any index)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (t + 1 < T) prefetch_rows(keys, entry_idx + (t + 1) * E, std::min<int64_t>(V, E), D, N);
      bad += indexer_row(q + t * H * D, keys, entry_idx + t * E, entry_valid + t * E, weights + t * H, H, D, E,
                         N, K, scale, s.data(), rows.data(), kts.data(), cached.data(), order.data(),
                         out_rows + t * K, out_valid + t * K);
    }
  }
  return bad;
}
"""

# Rows * entries * heads * dim from which the kernel runs on every thread (below, one).
THREADED_WORK = 1 << 16


def scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[T, E]: each row's score of each of its entries (the model's formula), -inf where the
    entry is not visible; what ``reference`` and the kernel rank."""
    t, e = entry_idx.shape
    keys_e = keys.index_select(0, entry_idx.reshape(-1)).view(t, e, keys.shape[-1])  # [T, E, D]
    per_head = torch.einsum("thd,ted->the", q.float(), keys_e.float()).relu() * scale
    index_scores = (per_head * weights.float().unsqueeze(-1)).sum(dim=1)  # [T, E]
    return index_scores.masked_fill(~entry_valid, float("-inf"))


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen entries' pool rows and visibility, [T, topk], in plain PyTorch: the model's
    formula, then a stable descending sort (ties: the lower column); a row of fewer than
    ``topk`` entries is padded with its first entry (pool row 0 without any), not visible."""
    t, e = entry_idx.shape
    index_scores = scores(q, keys, entry_idx, entry_valid, weights, scale)
    _, order = torch.sort(index_scores, dim=-1, descending=True, stable=True)
    picks = order[:, : min(topk, e)]
    rows, valid = entry_idx.gather(1, picks), entry_valid.gather(1, picks)
    if e < topk:  # the same columns, then padding no row sees
        pad = entry_idx[:, :1] if e else entry_idx.new_zeros(t, 1)
        rows = torch.cat([rows, pad.expand(t, topk - e)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(t, topk - e)], dim=1)
    return rows, valid


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load(_SOURCE)
    if lib is not None:
        fn = cpu_build.bind(
            lib,
            "indexer_topk_f32",
            [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int],
        )
        fn.restype = ctypes.c_int64
    return lib


def takes(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the C++ kernel runs these inputs (fp32 on the CPU, no autograd)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
        for t in (q, keys, weights)
    )


def _cpp(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = q.shape
    e = entry_idx.shape[1]
    q, keys, weights = q.contiguous(), keys.contiguous(), weights.contiguous()
    entry_idx, entry_valid = entry_idx.long().contiguous(), entry_valid.bool().contiguous()
    rows = torch.empty(t, topk, dtype=torch.long)
    valid = torch.empty(t, topk, dtype=torch.bool)
    if t == 0 or topk == 0:
        return rows, valid
    threads = torch.get_num_threads() if t * e * h * d >= THREADED_WORK else 1
    bad = lib.indexer_topk_f32(
        q.data_ptr(),
        keys.data_ptr(),
        entry_idx.data_ptr(),
        entry_valid.data_ptr(),
        weights.data_ptr(),
        rows.data_ptr(),
        valid.data_ptr(),
        t,
        h,
        d,
        e,
        keys.shape[0],
        topk,
        scale,
        threads,
    )
    if bad:
        raise IndexError(
            f"indexer_topk: {bad} visible entries index outside the key pool of {keys.shape[0]} rows"
        )
    return rows, valid


@torch.library.custom_op("deepinfer::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    entry_idx: torch.Tensor,
    entry_valid: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (roped), keys [N, D] (the index-key pool), entry_idx / entry_valid [T, E],
    weights [T, H] (per-head, already scaled) -> the chosen entries' pool rows and visibility,
    [T, topk]. A row with fewer visible entries than ``topk`` fills up with its first invisible
    columns (visibility False), as a stable sort of -inf scores would; with fewer than ``topk``
    entries (E < topk) the last columns repeat its first entry, not visible. So the width is
    ``topk`` whatever E is, and a compiled step traced at E >= topk also serves E < topk."""
    # opaque to torch.compile: the C++ kernel on fp32 CPU tensors, else the reference
    lib = _library() if takes(q, keys, weights) else None
    if lib is not None:
        return _cpp(lib, q, keys, entry_idx, entry_valid, weights, topk, scale)
    rows, picked = reference(q, keys, entry_idx, entry_valid, weights, topk, scale)
    return rows.contiguous(), picked.contiguous()  # the fake's layout


@indexer_topk.register_fake
def _(q, keys, entry_idx, entry_valid, weights, topk, scale):
    shape = (entry_idx.shape[0], topk)  # no min(topk, E): a step's width never specialises
    return entry_idx.new_empty(shape, dtype=torch.long), entry_valid.new_empty(shape, dtype=torch.bool)
