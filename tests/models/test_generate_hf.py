"""Greedy LLM.generate tokens equal transformers generate(do_sample=False) tokens."""

from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams


def test_greedy_generate_matches_transformers(v4_ckpt, hf_reference):
    llm = LLM(v4_ckpt)
    hf = hf_reference(v4_ckpt)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 258, (n,), generator=gen).tolist() for n in (1, 5, 9, 17, 30)]
    prompts.append(llm.tokenizer("Hello, DeepSeek!").input_ids)
    max_new = 24
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
        expected = ref[0, len(prompt) :].tolist()
        got = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":  # stopped on EOS: HF stops there too
            assert got == expected[: len(got)] and got[-1] in llm.eos_token_ids
        else:
            assert got == expected
