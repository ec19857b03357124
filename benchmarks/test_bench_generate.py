"""pytest-benchmark harness: ``pytest benchmarks/ --benchmark-only``.

Times greedy decode of the tiny V4 checkpoint for deepinfer and transformers in the same
run; compare the two rows of the report (the CLI script prints the ratio directly).
"""

from __future__ import annotations

import pytest
import torch
from bench_sizes import size

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

NEW_TOKENS = size(32, 4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench"), arch="deepseek_v4", seed=0)


@pytest.mark.parametrize("batch", [1, 8])
def test_deepinfer_generate(benchmark, checkpoint, batch):
    llm = LLM(checkpoint, max_num_seqs=batch)
    prompts = torch.randint(2, 258, (batch, 16), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = benchmark(llm.generate, prompts, params)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)


@pytest.mark.parametrize("batch", [1, 8])
def test_transformers_generate(benchmark, checkpoint, batch):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = torch.randint(2, 258, (batch, 16), generator=torch.Generator().manual_seed(0))

    def generate():
        with torch.no_grad():
            return hf.generate(prompts, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)

    out = benchmark(generate)
    assert out.shape == (batch, 16 + NEW_TOKENS)
