"""pytest-benchmark: offline throughput, deepinfer vs transformers on the same tiny V4 weights.

``pytest benchmarks/ --benchmark-only``. A 64-request version of ``deepinfer bench
throughput`` (prompt and output lengths uniform in [16, 128]); compare the two rows.
"""

from __future__ import annotations

import pytest
from bench_sizes import size

from deepinfer import LLM
from deepinfer.bench.workloads import (
    deepinfer_throughput,
    load_transformers_peer,
    random_workload,
    transformers_throughput,
)
from deepinfer.tiny import make_tiny_checkpoint

REQUESTS = size(64, 8)
LONGEST = size(128, 16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), arch="deepseek_v4", seed=0)
    return path, random_workload(REQUESTS, (16, LONGEST), (16, LONGEST), 258, seed=0)


def test_deepinfer_throughput(benchmark, setup):
    path, work = setup
    llm = LLM(path, max_num_seqs=REQUESTS, max_num_batched_tokens=2048)
    tok_s = benchmark.pedantic(deepinfer_throughput, args=(llm, work), rounds=2)
    benchmark.extra_info["output_tok_s"] = tok_s


def test_transformers_throughput(benchmark, setup):
    path, work = setup
    model = load_transformers_peer(path)
    run = benchmark.pedantic(transformers_throughput, args=(model, work, REQUESTS), rounds=2)
    benchmark.extra_info["output_tok_s"] = run.tok_s
    benchmark.extra_info["computed_tokens"] = run.computed_tokens
