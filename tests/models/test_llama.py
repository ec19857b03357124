"""The Llama family on the same engine: parity with transformers, chunking, batching."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams, load_model
from deepinfer.cache.session import Session
from deepinfer.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["llama", "llama_untied_llama3_rope"])
def llama_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)


def _hf(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model.eval()


@pytest.mark.parametrize("length", [1, 7, 33, 150])
def test_logits_match_transformers(llama_ckpt, length):
    ours, theirs = load_model(llama_ckpt), _hf(llama_ckpt)
    ids = torch.randint(0, 258, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() <= 1e-4


def test_parity_is_sensitive_to_the_weights(llama_ckpt):
    ours, theirs = load_model(llama_ckpt), _hf(llama_ckpt)
    with torch.no_grad():
        ours.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
        ids = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(0))
        assert (ours(ids).logits - theirs(ids).logits).abs().max() > 1e-2


def test_chunked_prefill_and_decode_match_one_shot(llama_ckpt):
    model = load_model(llama_ckpt)
    ids = torch.randint(0, 258, (2, 60), generator=torch.Generator().manual_seed(1))
    session = Session(model, 2, 60)
    with torch.no_grad():
        full = model(ids).logits
        parts = [session.feed(ids[:, :17]), session.feed(ids[:, 17:40])]
        parts += [session.feed(ids[:, t : t + 1]) for t in range(40, 60)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4


def test_greedy_generate_matches_transformers(llama_ckpt):
    llm, hf = LLM(llama_ckpt), _hf(llama_ckpt)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 258) for _ in range(n)] for n in (1, 6, 30)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_engine_modes_equal_alone(llama_ckpt):
    rng = random.Random(5)
    prefix = [rng.randrange(2, 258) for _ in range(40)]
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(2, 258) for _ in range(rng.randrange(1, 80))]
        for i in range(40)
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 10), temperature=0.0, ignore_eos=True) for _ in prompts
    ]
    alone_llm = LLM(llama_ckpt, enable_prefix_caching=False)
    alone = [alone_llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params, strict=True)]
    llm = LLM(llama_ckpt, num_cache_blocks=14, max_num_batched_tokens=48, async_scheduling=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    assert llm.engine.block_pools[0].num_free == llm.engine.num_blocks


def test_fake_quant_is_refused_for_models_without_it(llama_ckpt):
    with pytest.raises(ValueError, match="fake_quant"):
        load_model(llama_ckpt, fake_quant=True)


def test_tiny_llama_continuation_depends_on_the_context(llama_ckpt):
    """Guard for every Llama test that claims to exercise attention: changing only the
    first prompt token changes the greedy continuation (a tiny model that repeats its last
    token whatever came before would make batching, chunking and drafting tests vacuous)."""
    rng = random.Random(0)
    tail = [rng.randrange(3, 250) for _ in range(20)]
    llm = LLM(llama_ckpt)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[first] + tail for first in range(3, 13)], params, use_tqdm=False)
    continuations = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(continuations) >= 6, continuations
    assert any(t != tail[-1] for o in outs for t in o.outputs[0].token_ids)
