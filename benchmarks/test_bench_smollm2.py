"""pytest-benchmark: SmolLM2-135M-Instruct, deepinfer vs transformers on the same weights.

``pytest benchmarks/ --benchmark-only``. Batch-1 greedy decode of 32 tokens and a 16-request
batch; the ``deepinfer bench`` subcommands print the ratios and the bandwidth bound. Each
round repeats the same prompts, so prefix caching is off: no round reads what an earlier one
computed, as the peer cannot.
"""

from __future__ import annotations

import pytest
import torch
from bench_sizes import size

from deepinfer import LLM, SamplingParams
from deepinfer.bench.workloads import load_transformers_peer, random_workload
from deepinfer.weights.catalog import resolve_model

NEW = size(32, 4)
PROMPT = size(64, 16)


@pytest.fixture(scope="module")
def path():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def work(path):
    return random_workload(16, (PROMPT, PROMPT), (NEW, NEW), 49152, seed=0)


@pytest.mark.parametrize("batch", [1, 16])
def test_deepinfer_smollm2(benchmark, path, work, batch):
    llm = LLM(path, max_num_seqs=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    benchmark.pedantic(
        llm.generate, args=(work.prompts[:batch], params), kwargs={"use_tqdm": False}, rounds=3
    )
    assert llm.engine.block_pools[0].hit_blocks == 0


@pytest.mark.parametrize("batch", [1, 16])
def test_transformers_smollm2(benchmark, path, work, batch):
    model = load_transformers_peer(path)
    ids = torch.tensor(work.prompts[:batch])

    def run():
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)

    benchmark.pedantic(run, rounds=3)
