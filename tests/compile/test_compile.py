"""torch.compile of the model step (compilation.py): compiled logits equal eager, shapes are
dynamic (no recompiles across batch sizes after the first variants), the pass manager runs on
every Inductor graph and its cache key follows the pass sources.

Inductor compiles each graph slowly on a small CPU, so these tests use a 2-layer tiny V4 (one
sliding + hash-MoE layer, one CSA layer) and the fewest distinct shape variants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from deepinfer.cache.pools import CacheLayout, allocate_pools
from deepinfer.cache.step_chunks import SeqChunk, StepPadding
from deepinfer.cache.step_metadata import build_forward_batch
from deepinfer.compile.compilation import PassManager, compile_step
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def v4_2layer(tmp_path_factory) -> Path:
    """The 2-layer tiny V4, built once for the module's model and engine tests (neither writes
    to it: the engine test's compiled step is created after its eager engine)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4c"), arch="deepseek_v4", num_hidden_layers=2)


@pytest.fixture(scope="module")
def model(v4_2layer: Path):
    return load_model(v4_2layer)


def _step_inputs(model, lengths: list[int], starts: list[int], seed: int, padded: bool):
    layout = CacheLayout.from_specs(model.cache_spec(), 16)
    pools = allocate_pools(layout, 64, 8, torch.float32, torch.device("cpu"))
    chunks = [
        SeqChunk([i * 8 + k for k in range(8)], i, s, n, logits_offsets=list(range(n)))
        for i, (n, s) in enumerate(zip(lengths, starts, strict=True))
    ]
    padding = StepPadding.for_pools(64, 8) if padded else None
    positions, batch = build_forward_batch(layout, pools, chunks, torch.device("cpu"), padding)
    ids = torch.randint(0, 258, (positions.shape[0],), generator=torch.Generator().manual_seed(seed))
    return ids, positions, batch


def _both(model, compiled, lengths, starts, seed):
    """Eager and compiled logits of the same step, each on fresh (zeroed) pools."""
    with torch.inference_mode():
        eager = model.step(*_step_inputs(model, lengths, starts, seed, padded=False))
        got = compiled(*_step_inputs(model, lengths, starts, seed, padded=True))
    return eager, got


def test_compiled_logits_match_eager_without_recompiles(model):
    seen = []

    def count_nodes(graph: torch.fx.Graph) -> int:
        seen.append(len(graph.nodes))
        return 0

    compiled = compile_step(model, passes=[count_nodes])
    counters.clear()
    # compile for real (a graph-cache hit would skip the post-grad passes this test watches)
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)
    no_aot_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with no_cache, no_aot_cache:
        _check_matches_without_recompiles(model, compiled)
    manager = compiled.pass_manager
    assert manager.graphs_seen >= 1 and seen and manager.counts["count_nodes"] == 0


def _check_matches_without_recompiles(model, compiled) -> None:
    for lengths in ([5, 3], [7, 2, 9]):  # prefill chunks from position 0
        eager, got = _both(model, compiled, lengths, [0] * len(lengths), seed=len(lengths))
        assert (eager - got).abs().max() <= 1e-4
    graphs = counters["stats"]["unique_graphs"]
    for lengths in ([6, 4, 11, 2], [13, 5, 3, 8, 2]):  # more sequences, other lengths: no new graph
        eager, got = _both(model, compiled, lengths, [0] * len(lengths), seed=sum(lengths))
        assert (eager - got).abs().max() <= 1e-4
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled for a new batch size"


def test_pass_manager_cache_key_follows_pass_sources():
    def pass_a(graph: torch.fx.Graph) -> int:
        return 0

    def pass_b(graph: torch.fx.Graph) -> int:
        return len(graph.nodes) * 0

    assert PassManager([pass_a]).uuid() == PassManager([pass_a]).uuid()
    assert PassManager([pass_a]).uuid() != PassManager([pass_b]).uuid()
    assert PassManager([]).uuid() != PassManager([pass_a]).uuid()


def test_engine_greedy_outputs_equal_with_compile_on_and_off(v4_2layer: Path):
    """The engine with ``compile=True`` (chunked prefill, decode, mixed steps) gives the eager
    engine's tokens."""
    import random

    from deepinfer import LLM, SamplingParams

    path = v4_2layer
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 258) for _ in range(rng.randrange(1, 60))] for _ in range(10)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, compile=True, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager


@pytest.mark.parametrize("arch", ["deepseek_v41", "llama"])
def test_inductor_compiled_step_matches_eager_on_the_other_tiny_models(arch, tmp_path):
    """Inductor for real (C++ code generation) on the tiny V4.1 and Llama: one padded mixed
    step (prefill chunks beside decodes) gives the eager logits."""
    # Llama's layers are all alike: one is the whole path, and a third of the graph to compile
    path = make_tiny_checkpoint(
        tmp_path / arch, arch=arch, **({"num_hidden_layers": 1} if arch == "llama" else {})
    )
    # V4.1's QAT rounding turns last-bit differences (Inductor's fused sums against eager's)
    # into whole grid steps, as in the config fuzzer: compare without it
    other = load_model(path, fake_quant=False if arch == "deepseek_v41" else None)
    compiled = compile_step(other)
    lengths, starts = [7, 1, 12], [0, 0, 0]
    with torch.inference_mode():
        eager = other.step(*_step_inputs(other, lengths, starts, seed=3, padded=False))
        got = compiled(*_step_inputs(other, lengths, starts, seed=3, padded=True))
    assert (eager - got[: eager.shape[0]]).abs().max() <= 1e-4


def test_inductor_decode_with_every_fusion_pass_equals_eager_past_group_boundaries(tmp_path, monkeypatch):
    """The CUDA pipeline on the CPU: every fusion pass on (fused attention and MoE ops then
    run through Inductor's code generation), the engine decoding 40 tokens over HCA groups
    of 8 and CSA groups of 4, so many compressor groups close inside compiled steps: the
    eager engine's tokens, and chosen-token logprobs within 1e-4."""
    from deepinfer.compile_passes import PASSES

    from deepinfer import LLM, SamplingParams
    from deepinfer.compile import compilation

    monkeypatch.setattr(compilation, "default_passes", lambda device=None: list(PASSES))
    path = make_tiny_checkpoint(tmp_path / "short", arch="deepseek_v4_short_groups", num_hidden_layers=3)
    prompts = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((5, 13, 30))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    eager = LLM(path).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, compile=True, max_num_batched_tokens=32)
    # compile for real: a graph-cache hit would skip the passes whose matches are counted
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)
    no_aot_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with no_cache, no_aot_cache:
        compiled = llm.generate(prompts, params, use_tqdm=False)
    assert sum(llm.engine.runner.forward.pass_manager.counts.values()) > 0  # the fusions matched
    for a, b in zip(eager, compiled, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        diff = max(
            abs(p[t].logprob - q[t].logprob)
            for t, p, q in zip(x.token_ids, x.logprobs, y.logprobs, strict=True)
        )
        assert diff <= 1e-4, diff


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_compiled_llama_on_an_8bit_cache_equals_eager(kv, tmp_path):
    """A compiled Llama step writes and reads an int8 or fp8 cache through the Python path
    (RoPE, the Hadamard rotation of queries and keys, the row encoding) that Inductor
    compiles; the eager engine runs the C++ kernels: the same greedy tokens."""
    from deepinfer import LLM, SamplingParams

    # one layer: Llama's layers are all alike, each writes and reads its cache the same way
    path = make_tiny_checkpoint(
        tmp_path / "llama", arch="llama", seed=5, head_dim=32, hidden_size=128, num_hidden_layers=1
    )
    prompts = [[3, 17, 99, 4, 250, 31, 7], [12, 5, 88]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = LLM(path, kv_cache_dtype=kv, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, kv_cache_dtype=kv, compile=True, enable_prefix_caching=False, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
