"""``deepinfer perplexity``: llama-perplexity's protocol (chunks, second half scored, BOS),
checked against transformers' logits on the same checkpoint; KL and top-1 against a saved
base; the engine's full prompt log-probabilities under chunking and preemption."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.quality import base_logprobs, chunk_tokens, perplexity
from deepinfer.quality import scoring as perplexity_module
from deepinfer.tiny import make_tiny_checkpoint

CTX = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ppl") / "llama", arch="llama", seed=5, head_dim=32)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(3, 258, (7 * CTX + 5,), generator=gen).tolist()


def _hf_logprobs(ckpt, table: torch.Tensor) -> torch.Tensor:
    """transformers' log-probabilities for each chunk [n, ctx, V] (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(table).logits.float().log_softmax(-1)


def _reference(ckpt, table: torch.Tensor, shift: int = 0) -> float:
    """llama-perplexity's figure from transformers' logits: positions ctx/2 .. ctx-2 score
    the tokens after them (``shift`` moves the targets: the mutation)."""
    logp = _hf_logprobs(ckpt, table)
    first = table.shape[1] // 2
    rows = logp[:, first : table.shape[1] - 1]
    targets = table[:, first + 1 + shift : table.shape[1] + shift] if shift <= 0 else None
    if shift > 0:
        targets = torch.roll(table, -shift, dims=1)[:, first + 1 :]
    nll = -rows.gather(2, targets.unsqueeze(-1)).squeeze(-1)
    return math.exp(nll.double().mean().item())


def test_perplexity_equals_transformers_by_the_protocol(ckpt, tokens, monkeypatch):
    """The engine's perplexity over whole chunks (the tail that fills no chunk left out) equals
    the figure from transformers' logits at 1e-5 relative. Mutation check: scoring each
    position against the token two ahead moves it past the tolerance."""
    llm = LLM(ckpt, enable_prefix_caching=False)
    report = perplexity(llm, token_ids=tokens, ctx=CTX, batch=3)
    table = chunk_tokens(tokens, CTX)
    assert (report.chunks, report.scored_tokens) == (7, 7 * (CTX // 2 - 1))
    want = _reference(ckpt, table)
    assert report.ppl == pytest.approx(want, rel=1e-5)
    real = perplexity_module.scored_logprobs

    def off_by_one(*args, **kwargs):
        for logp, targets in real(*args, **kwargs):
            yield logp, torch.roll(targets, -1)

    monkeypatch.setattr(perplexity_module, "scored_logprobs", off_by_one)
    broken = perplexity(llm, token_ids=tokens, ctx=CTX, batch=3)
    assert broken.ppl != pytest.approx(want, rel=1e-5)


def test_kl_and_top1_against_a_saved_base(ckpt, tokens, tmp_path):
    """A base written from transformers' distributions: the engine's fp32 run has every top-1
    the base's and a KL divergence no larger than the base's fp16 rounding makes; an int8 K/V
    cache run reports the KL divergence and top-1 share computed from its own distributions by ``torch.nn.functional.kl_div`` (over the tokens
    whose base log-probability is above -16, as llama-perplexity sums it)."""
    table = chunk_tokens(tokens, CTX, chunks=4)
    first = CTX // 2
    hf = _hf_logprobs(ckpt, table)[:, first : CTX - 1]
    path = tmp_path / "base.safetensors"
    base_logprobs.save(path, table, list(hf))
    same = perplexity(
        LLM(ckpt, enable_prefix_caching=False), token_ids=tokens, ctx=CTX, chunks=4, kl_base=path
    )
    assert same.kl < 1e-4 and same.top1 == 1.0

    int8 = LLM(ckpt, kv_cache_dtype="int8", enable_prefix_caching=False)
    report = perplexity(int8, token_ids=tokens, ctx=CTX, chunks=4, kl_base=path)
    ours = torch.cat([logp for logp, _ in perplexity_module.scored_logprobs(int8, table)])
    ref = hf.reshape(-1, hf.shape[-1]).half().float()  # the base as saved (fp16)
    terms = torch.nn.functional.kl_div(ours, ref, log_target=True, reduction="none")
    kl = torch.where(ref > -16, terms, 0.0).sum(-1)  # llama-perplexity's sum: the base's tail left out
    assert report.kl == pytest.approx(kl.mean().item(), rel=1e-4, abs=1e-9)
    reverse = torch.nn.functional.kl_div(ref, ours, log_target=True, reduction="none")
    reverse = torch.where(ref > -16, reverse, 0.0).sum(-1).mean().item()
    assert report.kl != pytest.approx(reverse, rel=1e-4, abs=1e-9)  # mutation: the other direction
    assert report.top1 == pytest.approx((ref.argmax(-1) == ours.argmax(-1)).float().mean().item())


def test_a_base_over_other_tokens_is_refused(ckpt, tokens, tmp_path):
    llm = LLM(ckpt, enable_prefix_caching=False)
    path = tmp_path / "base.safetensors"
    perplexity(llm, token_ids=tokens, ctx=CTX, chunks=2, save_logits=path)
    with pytest.raises(ValueError, match="other tokens"):
        perplexity(llm, token_ids=tokens[1:], ctx=CTX, chunks=2, kl_base=path)
    with pytest.raises(ValueError, match="holds 2 chunks"):
        perplexity(llm, token_ids=tokens, ctx=CTX, chunks=3, kl_base=path)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 300),
    ctx=st.sampled_from([4, 8, 16, 32]),
    chunks=st.one_of(st.none(), st.integers(1, 10)),
    bos=st.one_of(st.none(), st.integers(0, 5)),
)
def test_chunks_are_whole_and_start_with_bos(n, ctx, chunks, bos):
    """As llama-perplexity cuts a text: whole chunks only (at most ``chunks``), each starting
    with BOS where the tokenizer adds one, the rest of the tokens in order; fewer than two
    chunks' worth of tokens is an error."""
    ids = list(range(100, 100 + n))
    if n < 2 * ctx:
        with pytest.raises(ValueError, match="needs at least"):
            chunk_tokens(ids, ctx, chunks, bos)
        return
    table = chunk_tokens(ids, ctx, chunks, bos)
    count = n // ctx if chunks is None else min(chunks, n // ctx)
    assert table.shape == (count, ctx)
    flat = torch.tensor(ids[: count * ctx]).view(count, ctx)
    assert torch.equal(table[:, 1:], flat[:, 1:])
    assert torch.equal(table[:, 0], flat[:, 0] if bos is None else torch.full((count,), bos))


def test_full_prompt_logprobs_survive_chunking_and_preemption(ckpt, tokens):
    """``prompt_logprobs_full`` rows are those of the request alone when its prompt is split
    over steps and other requests preempt it; each row holds the per-token prompt
    log-probability at the token it predicts."""
    prompts = [tokens[i : i + 40 + 7 * i] for i in range(6)]
    params = SamplingParams(max_tokens=4, prompt_logprobs=0, prompt_logprobs_full=True)
    alone = [
        LLM(ckpt, enable_prefix_caching=False).generate([{"prompt_token_ids": p}], params)[0] for p in prompts
    ]
    busy = LLM(
        ckpt, enable_prefix_caching=False, max_num_batched_tokens=24, num_cache_blocks=10, max_num_seqs=4
    )
    together = busy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b, p in zip(alone, together, prompts, strict=True):
        assert b.prompt_logprobs_full.shape == (len(p) - 1, a.prompt_logprobs_full.shape[1])
        torch.testing.assert_close(b.prompt_logprobs_full, a.prompt_logprobs_full, rtol=0, atol=1e-5)
        at_token = b.prompt_logprobs_full.gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
        listed = torch.tensor([b.prompt_logprobs[i + 1][t].logprob for i, t in enumerate(p[1:])])
        torch.testing.assert_close(at_token, listed, rtol=0, atol=1e-6)


def test_full_prompt_logprobs_need_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs_full"):
        SamplingParams(prompt_logprobs_full=True)


def test_the_command_prints_the_figures(ckpt, tmp_path, capsys):
    """The CLI scores a text file through the checkpoint's tokenizer and round-trips a base."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}" for i in range(200)))
    base = tmp_path / "base.safetensors"
    args = [str(ckpt), str(text), "--ctx", str(CTX), "--chunks", "3", "--compile", "off"]
    assert main(["perplexity", *args, "--save-logits", str(base)]) == 0
    assert main(["perplexity", *args, "--kl-base", str(base), "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "chunks: 3 x 32 tokens, 45 scored" in out
    assert out.count("PPL = ") == 2 and "Mean KLD: " in out and "Same top p: " in out
    assert main(["perplexity", str(ckpt), str(tmp_path / "missing.txt")]) != 0
