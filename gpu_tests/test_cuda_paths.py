"""CUDA-only checks, run by benchmarks/gpu_check.sh on an NVIDIA machine (never by the CPU CI:
``.ci/run`` tests ``tests/`` only; the logic of each path has a CPU test there). Ordered
cheapest first, so a stage cut short by its time limit still reports the most:

- the Triton sink-attention kernel (the op's CUDA implementation) equals the plain form;
- the Triton fp8 linear equals its CPU reference, and resident fp8/fp4 weights serve the
  dequantize-on-load engine's greedy tokens, with graphs captured;
- the fused MoE op on CUDA equals its CPU result;
- sampling with penalties runs on CUDA logits;
- a NaN row of CUDA logits (greedy or sampled) fails its request alone, with graphs captured;
- speculative decoding with every drafter (eager) drafts and gives the plain engine's greedy
  tokens (``drafter_check``, also run on the CPU by tests/sampling/test_drafter_check.py);
- CUDA graphs captured from the eager step, then from the compiled step, give the eager
  engine's greedy tokens on every tiny model, and pure-decode steps really replay graphs;
- an fp8 K/V cache on CUDA replays from captured graphs the eager engine's greedy tokens.

Cases whose step Inductor compiles carry the id ``compiled-step``: a compile costs more than
all the other cases together, so benchmarks/gpu_check.sh runs them (``-k compiled-step``) in a
late stage of their own, after the short ones (``-k "not compiled-step"``).

Greedy comparisons report each request's first divergent step with the reference's top-2
logprob gap and fail only at a clear margin (``greedy_compare``): kernels that round
differently may part at a near-tie.
"""

from __future__ import annotations

import random

import pytest
import torch
from drafter_check import METHODS, check_drafter
from greedy_compare import assert_same_up_to_near_ties, greedy_params
from spec_prompts import repeating_prompts

from deepinfer import LLM, SamplingParams
from deepinfer.cache import kv_dtypes
from deepinfer.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ARCHS = ["deepseek_v4", "deepseek_v41", "llama"]


def _prompts(seed: int, n: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(2, longest))] for _ in range(n)]


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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-step", "compiled-step"])
def test_resident_fp8_and_fp4_on_cuda_equal_cpu(compiled, tmp_path):
    """The Triton fp8 linear equals the CPU reference; a release-format tiny V4 served with
    its weights resident (graphs captured from the eager or the compiled step) gives the
    dequantize-on-load engine's greedy tokens on CUDA."""
    from deepinfer.kernels.quantized import fp8_block_linear

    from deepinfer.weights.quant import quantize_fp8_blocks

    g = torch.Generator().manual_seed(0)
    q, s = quantize_fp8_blocks(torch.randn(1000, 700, generator=g), (128, 128))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        x = torch.randn(33, 700, generator=g).to(dtype)
        ref = fp8_block_linear(x, q, s, 128, 128).float()
        got = fp8_block_linear(x.cuda(), q.cuda(), s.cuda(), 128, 128).float().cpu()
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=1, quant="fp8")
    prompts = _prompts(3, 6, 60)
    kw = {"device": "cuda", "dtype": "bfloat16", "compile": compiled, "capture_graphs": True}
    kept = LLM(str(path), **kw).generate(prompts, greedy_params(16), use_tqdm=False)
    plain = LLM(str(path), quantization="none", **kw).generate(prompts, greedy_params(16), use_tqdm=False)
    assert_same_up_to_near_ties(kept, plain)


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


def test_penalties_on_cuda(tmp_path):
    """Presence/frequency/repetition penalties on CUDA logits (their counts on the device)."""
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    llm = LLM(path, device="cuda", compile=False, capture_graphs=False)
    params = SamplingParams(
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        seed=0,
        ignore_eos=True,
    )
    outs = llm.generate(_prompts(2, 4, 20), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs), [
        (o.outputs[0].finish_reason, o.outputs[0].error) for o in outs
    ]


def test_a_nan_row_fails_its_request_alone_on_cuda(tmp_path):
    """The sampler's row checks on CUDA tensors, under captured graphs: the victim (its row
    NaN from its third token) ends with "error", the others keep the unfaulted run's tokens."""
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    llm = LLM(path, device="cuda", compile=False, max_num_seqs=8)
    prompts = _prompts(4, 6, 30)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    real = engine.executor.run

    def execute(prepared, input_ids):
        logits, features = real(prepared, input_ids)
        for chunk, row in zip(prepared.chunks, prepared.sample_rows, strict=True):
            req = chunk.request
            if row >= 0 and req.prompt_token_ids == prompts[victim] and len(req.output_token_ids) >= 2:
                logits = logits.clone()
                logits[row] = float("nan")
        return logits, features

    engine.executor.run = execute
    try:
        for victim in (0, 1):  # a sampled victim, then a greedy one
            outs = llm.generate(prompts, params, use_tqdm=False)
            for i, o in enumerate(outs):
                c = o.outputs[0]
                if i == victim:
                    assert c.finish_reason == "error" and c.token_ids == clean[i][:2], (i, c)
                else:
                    assert c.finish_reason == "length" and c.token_ids == clean[i], i
    finally:
        del engine.executor.run
    assert engine.pool.num_free == engine.num_blocks


@pytest.mark.parametrize(("arch", "method"), list(METHODS.items()))
def test_speculative_decoding_on_cuda_equals_plain_greedy(arch, method, tmp_path):
    """Drafting on CUDA (eager, so the drafting logic is what is tested here) under the
    options that let it draft (``drafter_check``: no logprobs, adaptive off, repeating
    prompts): it drafts, and greedy tokens equal the plain engine's; a sampled run keeps
    going (drafts' q on the device)."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    result = check_drafter(path, method, "cuda")
    print(f"{method}: drafted {result.drafted}, accepted {result.accepted}")
    assert result.drafted > 0
    assert_same_up_to_near_ties(result.plain, result.spec)
    spec = {"method": method, "adaptive": False}
    llm = LLM(
        path, device="cuda", max_num_seqs=8, compile=False, capture_graphs=False, speculative_config=spec
    )
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    outs = llm.generate(repeating_prompts(8), sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-step", "compiled-step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_equal_eager_on_cuda(arch, compiled, tmp_path):
    """Every bucket is captured at engine start (before the asynchronous worker runs) from
    the eager or the compiled step; replayed decode steps give the eager engine's tokens."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompts = _prompts(0, 12, 60)
    params = greedy_params(16)

    def run(**kw):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=64, **kw)
        return llm.generate(prompts, params, use_tqdm=False), llm

    eager, _ = run(compile=False, capture_graphs=False)
    graphs, llm = run(compile=compiled, capture_graphs=True)
    runner = llm.engine.runner.graphs
    assert runner is not None and runner.replays > 0
    assert sorted(runner.graphs) == runner.buckets
    assert_same_up_to_near_ties(eager, graphs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-step", "compiled-step"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_an_fp8_cache_on_cuda_captures_and_replays(arch, kv, compiled, tmp_path):
    """An fp8 K/V cache on CUDA (ATen's conversions, or Triton's in a compiled step; writes
    through byte views, also inside captured graphs): replayed decode steps give the eager
    CUDA engine's greedy tokens. (Not compared with the CPU: a last-bit difference before the
    fp8 rounding can move a value by a whole fp8 step.)"""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompts = _prompts(3, 8, 60)
    params = greedy_params(12)

    def run(step_compiled: bool, graphs: bool) -> tuple[list, LLM]:
        llm = LLM(
            path,
            device="cuda",
            kv_cache_dtype=kv,
            max_num_seqs=8,
            compile=step_compiled,
            capture_graphs=graphs,
        )
        return llm.generate(prompts, params, use_tqdm=False), llm

    eager, _ = run(False, False)
    replayed, llm = run(compiled, True)
    assert llm.engine.runner.pools[0].window.dtype == kv_dtypes.KV_CACHE_DTYPES[kv]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    assert_same_up_to_near_ties(eager, replayed)
