"""The benchmarks run (so they cannot rot): the pytest-benchmark suite once each with timing
off, and the CLI benchmarks at a tiny size, reporting the fairness facts they promise (the
peer's computed tokens beside the requested ones; fresh prompts per concurrency level)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from deepinfer.bench.workloads import (
    PeerProcesses,
    Workload,
    latency_workload,
    random_workload,
    transformers_throughput,
)
from deepinfer.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_pytest_benchmark_suite_runs(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            "benchmarks",
        ],
        cwd=ROOT,
        env={**os.environ, "DEEPINFER_BENCH_SMOKE": "1"},  # every benchmark's path, small sizes
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_cli_throughput_reports_the_peer_fairly(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "bench",
            "throughput",
            # the smallest workload that still forms two peer batches each way (sorted,
            # arrival order) in each of two rounds: the report's lines do not depend on its size
            "--num-requests",
            "4",
            "--prompt-len",
            "4",
            "8",
            "--output-len",
            "2",
            "4",
            "--peer-batch-sizes",
            "2",
            "--rounds",
            "2",
            "--threads",  # this process's count (conftest.py: one for each xdist worker, on its core)
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "length-sorted" in run.stdout and "arrival order" in run.stdout
    assert "tokens computed for" in run.stdout
    assert run.stdout.count("ratio deepinfer / best transformers") == 2  # one a round, alternated
    assert "ratio over 2 alternated rounds: median" in run.stdout


def test_each_round_gets_new_prompts():
    """A round that reran the same prompts would hit our prefix cache (the peer has none): every
    round's workload, and the warm-up's, has prompts of its own."""
    import argparse

    from deepinfer.bench.commands import round_workload

    args = argparse.Namespace(seed=0, num_requests=16, prompt_len=[16, 64], output_len=[2, 8])
    rounds = [round_workload(args, 258, r) for r in range(3)]
    warm = random_workload(16, (16, 64), (2, 8), 258, seed=args.seed + 1)
    prompts = [{tuple(p[:16]) for p in w.prompts} for w in (*rounds, warm)]
    assert rounds[0].prompts == random_workload(16, (16, 64), (2, 8), 258, seed=0).prompts
    for i in range(len(prompts)):
        for j in range(i):
            assert not prompts[i] & prompts[j]  # no shared first block


def test_sorted_batches_compute_fewer_wasted_tokens():
    """The peer's length-sorted batches decode less past each request's end than arrival
    order, and both report what they computed."""

    class Stub:
        def generate(self, ids, **kw):
            return ids

    work = random_workload(32, (4, 40), (1, 64), 258, seed=3)
    sorted_run = transformers_throughput(Stub(), work, 8, sort=True)
    unsorted_run = transformers_throughput(Stub(), work, 8, sort=False)
    assert sorted_run.credited_tokens == unsorted_run.credited_tokens == work.output_tokens
    assert work.output_tokens <= sorted_run.computed_tokens < unsorted_run.computed_tokens


def test_latency_levels_use_distinct_prompts():
    a, b = latency_workload(1, 16, 4, 258), latency_workload(4, 16, 4, 258)
    assert isinstance(a, Workload) and not any(p[:8] == a.prompts[0][:8] for p in b.prompts)


def test_the_peer_split_over_processes_computes_the_same_batches(tmp_path):
    """With replicas on our side the peer runs as as many processes: the same length-sorted
    batches (the same computed tokens as in one process, the partial batch included), dealt
    to the processes, every requested token credited."""

    class Stub:
        def generate(self, ids, **kw):
            return ids

    path = make_tiny_checkpoint(tmp_path / "v4", arch="deepseek_v4", seed=6)
    work = random_workload(21, (4, 30), (1, 12), 258, seed=7)
    peer = PeerProcesses(path, 2, 1)
    try:
        run = peer.run(work, 4)
    finally:
        peer.close()
    one = transformers_throughput(Stub(), work, 4, sort=True)
    assert run.computed_tokens == one.computed_tokens
    assert run.credited_tokens == work.output_tokens and run.tok_s > 0


def _script(name: str, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_decode_host_benchmarks_run():
    """The host-work, step-metadata and launch-count scripts behind RESULTS.md's
    device-resident token entry, at their smallest sizes."""
    host = _script(
        "host_overhead.py", "--batches", "2", "--steps", "4", "--repeats", "1", "--device-ms", "0.5"
    )
    assert host.count("| 2 |") == 4  # greedy and seeded, synchronous and asynchronous
    metadata = _script("step_metadata.py", "--batches", "2", "--lengths", "256", "--repeats", "1")
    assert "| llama | 2 | graph, max_model_len 256 |" in metadata
    launches = _script("launch_budget.py", "--no-big")
    assert "| llama | 3 |" in launches and "| deepseek_v4 |" in launches


def test_the_dspark_benchmark_runs(tmp_path):
    """``spec_dspark.py`` at its smallest: a tiny target with a random head, every mode, our
    modes' outputs checked equal to the plain run's."""
    import json

    from dspark_heads import random_head

    from deepinfer.tiny import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", arch="llama")
    random_head(tmp_path / "head", json.loads((target / "config.json").read_text()), seed=0)
    out = _script(
        "spec_dspark.py",
        *("--model", str(target), "--head", str(tmp_path / "head"), "--prompts", "2", "--max-tokens", "6"),
        *("--batch", "1", "2", "--rounds", "1"),
    )
    assert out.count("| deepinfer DSpark static |") == 2 and "| 2 | deepinfer plain |" in out
