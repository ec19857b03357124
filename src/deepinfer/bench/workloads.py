"""Benchmark workloads and peers, shared by ``deepinfer bench`` and ``benchmarks/``.

Every figure is a ratio against a peer measured in the same process on the same weights
(``transformers.generate``), or against the machine's memory-bandwidth bound measured in
the same run. Nothing here asserts a speed.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.sampling_params import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0
) -> Workload:
    """nano-vllm's bench shape: random token prompts, lengths uniform in the given ranges."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def measured_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """Streaming read bandwidth (GB/s): a sum over a tensor far larger than the caches, best
    of 5. A decode step's weight traffic is reads, so this is the bound's denominator."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def decode_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads: all but the unselected routed experts, and
    one row of an input embedding (unless it is tied to the output head, read whole)."""
    cfg = model.config
    tied = getattr(cfg, "tie_word_embeddings", False)
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            nbytes = nbytes * cfg.num_experts_per_tok // cfg.n_routed_experts
        if name in ("embed.weight", "model.embed_tokens.weight") and not tied:
            nbytes = p.shape[1] * p.element_size()
        total += nbytes
    return total


def deepinfer_throughput(llm, work: Workload) -> float:
    """Output tokens/s of ``llm.generate`` on the whole workload at once."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    return work.output_tokens / elapsed


def load_transformers_peer(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # always a local directory: never ask the hub
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@dataclass
class PeerRun:
    """One ``transformers.generate`` pass over a workload."""

    batch_size: int
    sort: bool  # batches formed from requests sorted by length
    tok_s: float  # requested output tokens per second (what a user receives)
    computed_tokens: int  # tokens it decoded: each batch runs to its longest request
    credited_tokens: int  # tokens the requests asked for


def transformers_throughput(
    model: nn.Module, work: Workload, batch_size: int, pad_id: int = 0, sort: bool = True
) -> PeerRun:
    """``transformers.generate`` over ``work`` in left-padded batches of ``batch_size``.

    Each batch decodes until its longest request is done; only the tokens the requests asked
    for are credited, and the tokens it computed are reported beside them. ``sort`` forms the
    batches from requests sorted by (output, prompt) length, the fair way to batch a static
    engine (little padding, little decoding past a request's end)."""
    start = time.perf_counter()
    computed = generate_batches(model, work, peer_batches(work, batch_size, sort), pad_id)
    elapsed = time.perf_counter() - start
    return PeerRun(batch_size, sort, work.output_tokens / elapsed, computed, work.output_tokens)


def peer_batches(work: Workload, batch_size: int, sort: bool = True) -> list[list[int]]:
    """Request indices in batches of ``batch_size``, in arrival order or formed from the
    requests sorted by (output, prompt) length."""
    order = list(range(len(work.prompts)))
    if sort:
        order.sort(key=lambda i: (work.output_lens[i], len(work.prompts[i])))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def generate_batches(model: nn.Module, work: Workload, batches: list[list[int]], pad_id: int = 0) -> int:
    """``transformers.generate`` on each batch of ``work``'s requests (indices), left-padded,
    each decoding to its longest request; returns the tokens it computed."""
    computed = 0
    for batch in batches:
        prompts = [work.prompts[i] for i in batch]
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        new = max(work.output_lens[i] for i in batch)
        computed += new * len(batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
            )
    return computed


def transformers_throughput_runs(model: nn.Module, work: Workload, batch_sizes: list[int]) -> list[PeerRun]:
    """Every batch size, length-sorted and in arrival order (the best is the peer to beat)."""
    return [
        transformers_throughput(model, work, bs, sort=sort) for bs in batch_sizes for sort in (True, False)
    ]


class PeerProcesses:
    """The peer as data-parallel replicas, as fair as ours (``data_parallel_replicas``):
    ``processes`` worker processes, each loading the checkpoint into ``transformers`` on
    ``threads`` threads. A workload's length-sorted batches are dealt to them by the tokens
    each batch computes (LPT) and run at once; the wall time is until the last one ends. On a
    small model a single process leaves a core idle as ours does (benchmarks/RESULTS.md), so a
    comparison that splits our engine must split the peer too."""

    def __init__(self, path: Path, processes: int, threads: int) -> None:
        from deepinfer.distributed.replicas import ReplicaPool

        self.processes = processes
        self.pool = ReplicaPool(processes, _peer_worker, (str(path), threads))
        self.pool.wait_ready()

    def run(self, work: Workload, batch_size: int) -> PeerRun:
        from deepinfer.distributed.replicas import balanced_shares

        batches = peer_batches(work, batch_size)
        costs = [len(b) * max(work.output_lens[i] for i in b) for b in batches]
        shares = balanced_shares(costs, self.processes)
        start = time.perf_counter()
        for k, share in enumerate(shares):
            self.pool.submit(k, (work, [batches[b] for b in share]), False)
        computed = sum(self.pool.collect(k, None) for k in range(self.processes))
        elapsed = time.perf_counter() - start
        return PeerRun(batch_size, True, work.output_tokens / elapsed, computed, work.output_tokens)

    def close(self) -> None:
        self.pool.close()


def _peer_worker(conn, path: str, threads: int) -> None:
    """A ``PeerProcesses`` worker: ``transformers`` on ``threads`` threads, warmed up with one
    small batch, then the batches it is sent (a workload and its batches' request indices)."""
    from deepinfer.distributed.replicas import serve

    torch.set_num_threads(threads)

    def start():
        model = load_transformers_peer(Path(path))
        transformers_throughput(model, Workload([[2, 3, 4, 5]] * 2, [4, 4]), 2)

        def run(share, _progress) -> int:
            work, batches = share
            return generate_batches(model, work, batches)

        return run

    serve(conn, start)


def decode_bs1(llm, prompt_len: int = 32, new_tokens: int = 128) -> dict[str, float]:
    """Batch-1 decode tokens/s (prefill excluded) against the bandwidth bound of this machine."""
    prompt = random_workload(1, (prompt_len, prompt_len), (1, 1), llm.vocab_size, seed=1).prompts[0]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    tok_s = (new_tokens - 1) / (m.finished_time - m.first_token_time)
    bound = measured_bandwidth_gbs() * 1e9 / decode_weight_bytes(llm.model)
    return {"decode_tok_s": tok_s, "bound_tok_s": bound, "fraction_of_bound": tok_s / bound}


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def latency_workload(concurrency: int, prompt_len: int, output_len: int, vocab: int) -> Workload:
    """Fresh prompts for each concurrency level (seeded by it): an engine measured at several
    levels must not find the previous level's prompts in its prefix cache."""
    return random_workload(
        concurrency, (prompt_len, prompt_len), (output_len, output_len), vocab, seed=1000 + concurrency
    )


def deepinfer_latency(llm, concurrency: int, prompt_len: int, output_len: int) -> dict[str, float]:
    """Mean TTFT and time per output token with ``concurrency`` requests in flight, plus the
    output tok/s of the whole batch."""
    work = latency_workload(concurrency, prompt_len, output_len, llm.vocab_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = sum(o.metrics.ttft for o in outs) / len(outs)
    tpot = sum(o.metrics.tpot for o in outs) / len(outs)
    return {"ttft_s": ttft, "tpot_s": tpot, "tok_s": concurrency * output_len / elapsed}


def transformers_latency(
    model: nn.Module, concurrency: int, prompt_len: int, output_len: int, vocab: int
) -> dict:
    """The same measurement for ``transformers.generate`` with a batch of ``concurrency``."""
    work = latency_workload(concurrency, prompt_len, output_len, vocab)
    ids = torch.tensor(work.prompts)

    def run(new: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new)
        return time.perf_counter() - start

    ttft = run(1)
    total = run(output_len)
    return {
        "ttft_s": ttft,
        "tpot_s": (total - ttft) / (output_len - 1),
        "tok_s": concurrency * output_len / total,
    }
