"""CUDA-only checks, run by benchmarks/gpu_check.sh on an NVIDIA machine (never by the CPU CI:
``.ci/run`` tests ``tests/`` only; the logic of each path has a CPU test there).

- the engine with compile + CUDA graphs gives the eager engine's greedy tokens on every tiny
  model, and pure-decode steps really replay graphs;
- the Triton sink-attention kernel (the op's CUDA implementation) equals the plain form;
- the fused MoE and rejection ops run on CUDA tensors and equal their CPU results.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41", "llama"])
def test_graphs_and_compile_equal_eager_on_cuda(arch, tmp_path):
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=64, **kw)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, llm

    eager, _ = run(compile=False, capture_graphs=False)
    graphs, llm = run(compile=True, capture_graphs=True)
    assert graphs == eager
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0


def test_triton_sink_attention_on_cuda():
    from deepinfer.kernels.sink_attention import sink_attention

    from deepinfer.models.layers.attention import attention_with_sink

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, d = 37, 8, 128
    q = torch.randn(t, h, d, device="cuda", generator=g)
    kv = [torch.randn(t, n, d, device="cuda", generator=g) for n in (128, 300)]
    vis = [torch.rand(t, n, device="cuda", generator=g) > 0.2 for n in (128, 300)]
    sink = torch.randn(h, device="cuda", generator=g)
    ref = attention_with_sink(q, list(zip(kv, vis, strict=True)), sink, d**-0.5)
    got = sink_attention(q, kv, vis, sink, d**-0.5)  # dispatches to the Triton kernel on CUDA
    assert (got - ref).abs().max() <= 1e-4


def test_fused_ops_on_cuda_equal_cpu():
    gen = torch.Generator().manual_seed(1)
    n, d, e, inter, k = 64, 64, 16, 32, 4
    args = (
        torch.randn(n, d, generator=gen),
        torch.randn(n, e, generator=gen),
        torch.randn(e, generator=gen),
        None,
        torch.randn(e, inter, d, generator=gen),
        torch.randn(e, d, inter, generator=gen),
        torch.randn(e, inter, d, generator=gen),
    )
    cpu = torch.ops.deepinfer.fused_moe(*args, k, "sqrtsoftplus", True, torch.tensor(2.0), 10.0)
    cuda_args = tuple(a.cuda() if a is not None else None for a in args)
    got = torch.ops.deepinfer.fused_moe(*cuda_args, k, "sqrtsoftplus", True, torch.tensor(2.0).cuda(), 10.0)
    assert (got.cpu() - cpu).abs().max() <= 1e-3


@pytest.mark.parametrize(
    ("arch", "method"), [("deepseek_v41", "dspark"), ("deepseek_v4", "mtp"), ("llama", "ngram")]
)
def test_speculative_decoding_on_cuda_equals_plain_greedy(arch, method, tmp_path):
    """Drafting with compile on (graphs serve the undrafted decode steps): greedy tokens equal
    the plain engine's; a sampled run keeps going (drafts' q on the device)."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(path, device="cuda", max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cuda", max_num_seqs=8, speculative={"method": method})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec.stats.drafted > 0
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(prompts, sampled, use_tqdm=False))
