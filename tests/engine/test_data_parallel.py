"""Data-parallel attention on CPU ranks (gloo): each rank runs its own requests over its own
KV cache, the routed experts split over the ranks and reached by all-to-all (tiny V4, V4.1,
fp8/fp4 V4) or whole on every rank (Llama replicas). Greedy tokens equal one process and
logprobs stay within 1e-4 on a mixed workload (chunked prefill, batching, prefix caching,
preemption); the all-to-all exchange's counted bytes match an independent count and its
analytic expectation; EPLB counts every rank's tokens."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parallel_workloads import assert_same, routed_expert_bytes, tokens_and_logprobs, workload

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.eplb import ExpertLoadWindow
from deepinfer.distributed.expert_parallel import AllToAllDispatch, expected_remote_ranks
from deepinfer.tiny import make_tiny_checkpoint


def _expert_bytes(model) -> int:
    return sum(routed_expert_bytes(m) for m in model.modules() if hasattr(m, "expert_offset"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per (arch, quant), built on first use: the checkpoint, the workload, the one-process
    engine's tokens and logprobs and its routed experts' bytes. The checkpoint and the
    one-process engine do not depend on the rank count or on expert parallel, so the cases
    that differ only there share them; the engine is closed once measured."""
    built: dict[tuple[str, str | None], tuple] = {}

    def get(arch: str, quant: str | None) -> tuple:
        if (arch, quant) not in built:
            path = make_tiny_checkpoint(
                tmp_path_factory.mktemp(f"{arch}-{quant}"), arch=arch, seed=11, quant=quant
            )
            # a shared prefix of at least one full block (V4's blocks hold 128 tokens)
            prompts, params = workload(5, shared_len=40 if arch == "llama" else 140)
            # QAT fake-quant rounds activations to fp8/fp4: a 1e-7 difference from another batch
            # composition can flip one rounding and move a logprob by about 1e-3, past the 1e-4
            # tolerance, so the DeepSeek runs compare with it
            # off; a request's logits independent of its batch is batch_invariant's job
            exact = {} if arch == "llama" else {"fake_quant": False}
            single = LLM(str(path), max_num_batched_tokens=48, **exact)
            expected = tokens_and_logprobs(single.generate(prompts, params, use_tqdm=False))
            built[arch, quant] = (path, prompts, params, exact, expected, _expert_bytes(single.model))
            single.close()
        return built[arch, quant]

    return get


@pytest.mark.parametrize(
    ("arch", "quant", "ranks", "expert_parallel"),
    [
        ("deepseek_v4", None, 2, True),
        ("deepseek_v41", None, 2, True),
        ("deepseek_v4", "fp8", 4, True),
        ("deepseek_v41", None, 4, True),
        ("deepseek_v4", None, 2, False),  # whole replicas, no exchange
        ("llama", None, 2, False),
    ],
)
def test_data_parallel_equals_one_process(one_process, arch, quant, ranks, expert_parallel):
    """Every rank gets requests; tokens equal one process, logprobs within 1e-4, also on a
    second pass that hits each rank's own prefix cache; with expert parallel each rank holds
    1/N of the routed experts."""
    path, prompts, params, exact, expected, whole = one_process(arch, quant)
    llm = LLM(
        str(path),
        **exact,
        data_parallel_size=ranks,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=48,
    )
    placed: list[int] = []
    scheduler = llm.engine.scheduler
    add = scheduler.add
    scheduler.add = lambda request: (add(request), placed.append(request.dp_rank))
    preempted = []
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = tokens_and_logprobs(outs)
        again = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
        hits = [pool.hit_blocks for pool in llm.engine.block_pools]
        preempted = [r for s in scheduler.ranks for r in s.running + list(s.waiting)]
        part = _expert_bytes(llm.model)
    finally:
        llm.close()
    assert_same(got, expected)
    assert_same(again, expected)
    assert sorted(set(placed)) == list(range(ranks))
    assert all(h > 0 for h in hits)  # the shared prefix was cached on every rank
    assert not preempted  # nothing left behind
    if arch != "llama":
        assert part * (ranks if expert_parallel else 1) == whole > 0


def test_preemption_under_data_parallel_recomputes_the_same_tokens(tmp_path):
    """Two 128-token blocks per rank and three requests each crossing into a second block:
    requests are preempted and recomputed on their rank, and the tokens stay one process's."""
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=12)
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 258) for _ in range(rng.randrange(112, 124))] for _ in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    single = LLM(str(path), fake_quant=False)
    expected = tokens_and_logprobs(single.generate(prompts, params, use_tqdm=False))
    llm = LLM(
        str(path), fake_quant=False, data_parallel_size=2, enable_expert_parallel=True, num_cache_blocks=2
    )
    requests = []
    add = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda request: (add(request), requests.append(request))
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    assert_same(tokens_and_logprobs(outs), expected)
    assert sum(r.num_preemptions for r in requests) > 0
    assert {r.dp_rank for r in requests} == {0, 1}
    assert sum(o.metrics.num_generated_tokens for o in outs) == 6 * 20


def test_eplb_counts_every_ranks_tokens_and_keeps_the_outputs(tmp_path):
    """EPLB under data parallel: the per-expert counts rank 0 balances are the sums over
    the ranks (equal to one process counting every token), and rebalancing every 3 steps
    with 2 redundant experts keeps the tokens."""
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=13)
    prompts, params = workload(6, n=6)
    single = LLM(str(path), fake_quant=False)
    window = ExpertLoadWindow(single.model, 10_000)
    expected = tokens_and_logprobs(single.generate(prompts, params, use_tqdm=False))
    window.snapshot()
    counted_alone = window.total()
    llm = LLM(
        str(path),
        fake_quant=False,
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_step_interval=3,
        eplb_window_size=10_000,
        num_redundant_experts=2,
    )
    try:
        got = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
        engine = llm.engine
        assert engine.executor.placement is not None and engine.executor.steps_counted >= 3
        counted = engine.executor.eplb.total()
    finally:
        llm.close()
    assert_same(got, expected)
    assert torch.equal(counted, counted_alone)


class _FakeMoE:
    """What the dispatcher reads of a MoE layer: expert e multiplies by (e + 1)."""

    def __init__(self, rank: int, held: int) -> None:
        self.rank, self.held_experts, self.replica_maps = rank, held, None

    def run_routed(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        scale = (weights * (self.rank * self.held_experts + slots + 1).to(weights.dtype)).sum(1)
        return x * scale[:, None]


def _dispatch_rank(rank: int, size: int, port: int, experts: int, top_k: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    gen = torch.Generator().manual_seed(rank)
    tokens = 500 + 37 * rank
    x = torch.randn(tokens, 8, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    dispatch = AllToAllDispatch(rank, size)
    out = dispatch(_FakeMoE(rank, experts // size), x, weights, ids)
    want = x * (weights * (ids + 1).float()).sum(1)[:, None]
    held = experts // size
    remote = sum(len({int(e) // held for e in row} - {rank}) for row in ids)
    results.put(
        (
            rank,
            float((out - want).abs().max()),
            dispatch.dispatch_rows,
            remote,
            dispatch.payload_bytes,
            dispatch.combine_rows,
            tokens,
        )
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(("size", "experts", "top_k"), [(2, 8, 2), (4, 16, 3)])
def test_all_to_all_dispatch_routes_counts_and_matches_the_analytic_volume(size, experts, top_k):
    """Each token reaches exactly the ranks holding its experts: outputs equal the local
    computation, the counted rows equal an independent count of distinct remote ranks, the
    payload bytes are those rows' vectors, and the rows per token match the exact uniform-
    routing expectation within 5% (the large-E approximation, a deliberately wrong model for
    so few experts, is further off and would fail the same check)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    procs = [
        context.Process(target=_dispatch_rank, args=(r, size, port, experts, top_k, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    rows = [results.get() for _ in procs]
    for p in procs:
        p.join(timeout=60)
    dispatched = tokens = 0
    combined = 0
    for _, err, dispatch_rows, remote, payload, combine_rows, n in rows:
        assert err < 1e-5
        assert dispatch_rows == remote
        assert payload == (dispatch_rows + combine_rows) * 8 * 4
        dispatched += dispatch_rows
        combined += combine_rows
        tokens += n
    assert combined == dispatched  # every row sent out comes back once
    per_token = dispatched / tokens
    assert per_token == pytest.approx(expected_remote_ranks(size, top_k, experts), rel=0.05)
    assert per_token != pytest.approx(expected_remote_ranks(size, top_k), rel=0.05)


def test_option_conflicts_are_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=1)
    with pytest.raises(ValueError, match="data_parallel_size > 1 with tensor_parallel_size > 1"):
        LLM(str(path), data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config with data_parallel_size > 1 is refused"):
        LLM(
            str(path),
            data_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(path), data_parallel_size=0)
