"""The routed experts' grouped forms (no host read, so a CUDA graph can capture them) against
the loops the CPU runs: fp4 experts gathered per pair and in the grouped Triton kernel (run by
Triton's interpreter on CPU tensors) equal the per-expert loop; the Triton grid's block map
covers every row once for any routing; on ``meta`` tensors both ops take the grouped forms,
which the capture guard passes, while the loops are reported with their line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from capture_guard import META, CaptureGuard, guarded_capture
from deepinfer.kernels import quantized
from deepinfer.kernels.fused_moe import fused_moe
from deepinfer.kernels.moe import routed_experts, routed_experts_grouped, routed_experts_reference
from deepinfer.kernels.quantized import fp4_expert_loop, routed_experts_fp4, routed_experts_fp4_gathered

from deepinfer.weights.quant import quantize_fp4

EXPERTS, HIDDEN, INTER, LIMIT = 5, 64, 96, 7.0


def _fp4_experts(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(w1, s1, w2, s2, w3, s3) of ``EXPERTS`` random experts in the release's fp4 format."""
    out = []
    for shape in ((INTER, HIDDEN), (HIDDEN, INTER), (INTER, HIDDEN)):
        pairs = [quantize_fp4(torch.randn(*shape, generator=gen)) for _ in range(EXPERTS)]
        out += [torch.stack([p for p, _ in pairs]).view(torch.uint8), torch.stack([s for _, s in pairs])]
    return tuple(out)


def _routing(gen: torch.Generator, tokens: int, k: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [tokens, k]: distinct experts per token among the first ``used``."""
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen), ids


@pytest.mark.parametrize(("tokens", "k", "used"), [(1, 2, EXPERTS), (7, 2, 3), (40, 3, EXPERTS), (6, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_fp4_experts_equal_the_loop(tokens, k, used, dtype):
    """Same inputs, both paths: the CPU op (the loop, bit for bit) and the grouped form to
    rounding; experts with no rows (``used`` < all) and one expert taking every row."""
    gen = torch.Generator().manual_seed(tokens * 10 + k)
    packed = _fp4_experts(gen)
    weights, ids = _routing(gen, tokens, k, used)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    loop = fp4_expert_loop(x, weights, ids, packed, LIMIT)
    assert torch.equal(routed_experts_fp4(x, weights, ids, *packed, LIMIT), loop)
    got = routed_experts_fp4_gathered(x, weights, ids, *packed, LIMIT)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - loop.float()).abs().max() <= tol * loop.float().abs().max()


def test_gathered_chunks_cover_every_pair(monkeypatch):
    """More pairs than one chunk, and a chunk size that leaves a ragged last chunk."""
    gen = torch.Generator().manual_seed(3)
    packed = _fp4_experts(gen)
    weights, ids = _routing(gen, 11, 2, EXPERTS)
    x = torch.randn(11, HIDDEN, generator=gen)
    monkeypatch.setattr(quantized, "PAIR_CHUNK", 5)
    got = routed_experts_fp4_gathered(x, weights, ids, *packed, LIMIT)
    loop = fp4_expert_loop(x, weights, ids, packed, LIMIT)
    assert (got - loop).abs().max() <= 1e-5 * loop.abs().max()


@pytest.mark.parametrize(
    "counts", [[0, 0, 5, 0], [1, 1, 1, 1], [17, 0, 16, 33], [0, 0, 0, 64], [300, 2, 0, 1]]
)
@pytest.mark.parametrize("block_m", [16, 64])
def test_expert_blocks_cover_every_row_once(counts, block_m):
    """Each real block holds rows of one expert only, at most ``block_m``, and the blocks
    together hold every row exactly once, whatever the split; the rest of the grid is empty."""
    from deepinfer.kernels.quantized_triton import expert_blocks

    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(offsets[-1])
    expert, first, end = expert_blocks(offsets, rows, block_m)
    assert expert.shape[0] == -(-rows // block_m) + min(len(counts), rows)
    seen = torch.zeros(rows, dtype=torch.long)
    starts = [0, *offsets.tolist()[:-1]]
    for e, a, b in zip(expert.tolist(), first.tolist(), end.tolist(), strict=True):
        assert 0 <= b - a <= block_m
        if b > a:
            assert starts[e] <= a and b <= offsets[e]
            seen[a:b] += 1
    assert torch.equal(seen, torch.ones(rows, dtype=torch.long))


def test_grouped_forms_pass_the_capture_guard():
    """On ``meta`` both ops run their grouped forms (the loop cannot: ``bincount`` has no
        values to count), and the guard finds nothing in them, in the fused MoE op (gate and
    experts, which compiled CUDA steps run) or in the Triton grid's map."""
    from deepinfer.kernels.quantized_triton import expert_blocks

    n, k = 6, 2
    x = torch.randn(n, HIDDEN, device=META)
    weights, ids = torch.rand(n, k, device=META), torch.zeros(n, k, dtype=torch.long, device=META)
    packed = [t.to(META) for t in _fp4_experts(torch.Generator().manual_seed(0))]
    w1, w3 = (torch.randn(EXPERTS, INTER, HIDDEN, device=META) for _ in range(2))
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=META)
    guarded_capture(lambda: routed_experts_fp4(x, weights, ids, *packed, LIMIT))
    guarded_capture(lambda: routed_experts(x, weights, ids, w1, w2, w3, LIMIT))
    bf16 = [t.bfloat16() for t in (x, w1, w2, w3)]
    guarded_capture(lambda: routed_experts_grouped(bf16[0], weights, ids, *bf16[1:], LIMIT))
    logits, bias = torch.randn(n, EXPERTS, device=META), torch.zeros(EXPERTS, device=META)
    scale = torch.tensor(1.0, device=META)
    guarded_capture(lambda: fused_moe(x, logits, bias, None, w1, w2, w3, k, "sigmoid", True, scale, LIMIT))
    offsets = torch.zeros(EXPERTS, dtype=torch.int32, device=META)
    with CaptureGuard() as found:
        expert_blocks(offsets, n * k, 16)
    assert not found, found


@pytest.mark.parametrize(
    ("run", "where"),
    [
        (lambda x, w, i, fp4, fl: fp4_expert_loop(x, w, i, tuple(fp4), LIMIT), "kernels/quantized.py"),
        (lambda x, w, i, fp4, fl: routed_experts_reference(x, w, i, *fl, LIMIT), "kernels/moe.py"),
    ],
    ids=["fp4", "float"],
)
def test_guard_reports_the_host_read_loops(run, where):
    """Mutation check: the loops the CPU keeps, run where a capture would, are reported with
    the line that counts the experts on the host."""
    n, k = 3, 2
    x = torch.randn(n, HIDDEN, device=META)
    weights, ids = torch.rand(n, k, device=META), torch.zeros(n, k, dtype=torch.long, device=META)
    fp4 = [t.to(META) for t in _fp4_experts(torch.Generator().manual_seed(0))]
    w13 = torch.randn(EXPERTS, INTER, HIDDEN, device=META)
    floats = (w13, torch.randn(EXPERTS, HIDDEN, INTER, device=META), w13)
    with pytest.raises(AssertionError, match=rf"device sync aten.bincount.default at \S*{where}"):
        guarded_capture(lambda: run(x, weights, ids, fp4, floats))


_TRITON = """
import torch
from deepinfer.kernels.quantized import fp4_expert_loop, routed_experts_fp4_triton
from deepinfer.weights.quant import quantize_fp4
g = torch.Generator().manual_seed(0)
experts, hidden, inter = 6, 64, 96
packed = []
for shape in ((inter, hidden), (hidden, inter), (inter, hidden)):
    pairs = [quantize_fp4(torch.randn(*shape, generator=g)) for _ in range(experts)]
    packed += [torch.stack([p for p, _ in pairs]).view(torch.uint8), torch.stack([s for _, s in pairs])]
# one token; rows spread over some experts; every row on one expert; more than 256 pairs
for tokens, k, used in ((1, 2, 6), (9, 2, 4), (20, 1, 1), (140, 2, 6)):
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    ref = fp4_expert_loop(x, weights, ids, tuple(packed), 7.0)
    got = routed_experts_fp4_triton(x, weights, ids, *packed, 7.0)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4, (tokens, k, used)
print("ok")
"""


def test_grouped_triton_kernel_equals_the_loop_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", _TRITON], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
