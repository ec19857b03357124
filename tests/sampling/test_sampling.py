"""Sampling is checked statistically against the exact target distribution (chi-square)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.sampling.sampler import (
    SamplingRow,
    apply_processors,
    filtered_log_probs,
    greedy_tokens,
    make_generator,
    sample,
    sample_token,
)
from deepinfer.sampling_params import SamplingParams


def _chi2_critical(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a normal z (z=4: p ~ 3e-5)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _expected(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """The target distribution written out from the definitions (vLLM order: temperature,
    then top-k, then top-p over the renormalised top-k distribution, then min-p)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_mass = sum(probs[i].item() for i in order)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for idx in order:
        keep[idx] = True
        mass += probs[idx].item() / kept_mass
        if mass >= top_p:
            break
    target = torch.where(keep, probs, torch.zeros_like(probs))
    target = target / target.sum()
    target = torch.where(target >= min_p * target.max(), target, torch.zeros_like(target))
    return target / target.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, -1, 1.0, 0.0),
        (1.3, 5, 1.0, 0.0),
        (1.0, -1, 0.8, 0.0),
        (0.9, 6, 0.7, 0.0),
        (1.0, -1, 1.0, 0.1),
        (1.2, 8, 0.9, 0.05),
    ],
)
def test_sampled_frequencies_match_the_target_distribution(temperature, top_k, top_p, min_p):
    outside, chi2, df = _sampler_chi_square(temperature, top_k, top_p, min_p)
    assert outside == 0, "sampled a token outside top-k/top-p/min-p"
    if df > 0:
        assert chi2 < _chi2_critical(df), f"chi2={chi2:.1f} df={df}"


def _sampler_chi_square(temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[int, float, int]:
    """(samples outside the target's support, chi-square over the support, df) of 20000
    draws of the engine's sampler against the distribution written from the definitions."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=123)
    gen = make_generator(params, torch.device("cpu"))
    n = 20000
    rows = [SamplingRow(params, gen, [], [], [])] * n  # one request drawing n positions in a batch
    counts = torch.bincount(
        torch.tensor(sample(logits.expand(n, -1), rows, positions=list(range(n)))), minlength=12
    )
    target = _expected(logits, temperature, top_k, top_p, min_p)
    support = target > 0
    exp = target[support] * n
    chi2 = (((counts[support].double() - exp) ** 2) / exp).sum().item()
    return int(counts[~support].sum()), chi2, int(support.sum()) - 1


@pytest.mark.parametrize("broken", ["top_p", "temperature"])
def test_a_broken_sampler_fails_the_frequency_test(broken, monkeypatch):
    """Mutation check: a sampler that ignores top-p (or temperature) is caught by the test
    above (samples outside the support, or a chi-square past its critical value)."""
    from deepinfer.sampling import sampler

    original = sampler.filter_log_probs

    def ignoring(logits, temperature, top_k, top_p, min_p):
        if broken == "top_p":
            top_p = torch.ones_like(top_p)
        else:
            temperature = torch.ones_like(temperature)
        return original(logits, temperature, top_k, top_p, min_p)

    monkeypatch.setattr(sampler, "filter_log_probs", ignoring)
    outside, chi2, df = _sampler_chi_square(0.7, -1, 0.8, 0.0)
    assert outside > 0 or chi2 > _chi2_critical(df)


def test_filtered_distribution_equals_definition():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    for temperature, top_k, top_p, min_p in [
        (0.5, 10, 0.9, 0),
        (1.0, -1, 0.3, 0),
        (2.0, 3, 1.0, 0),
        (1, -1, 1, 0.2),
    ]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        got = filtered_log_probs(logits, params).exp().double()
        assert torch.allclose(got, _expected(logits, temperature, top_k, top_p, min_p), atol=1e-6)


def test_greedy_is_argmax_and_seed_is_reproducible():
    logits = torch.randn(50)
    assert sample_token(logits, SamplingParams(temperature=0.0), None) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [
        [sample_token(logits, params, g) for _ in range(20)]
        for g in (make_generator(params, torch.device("cpu")), make_generator(params, torch.device("cpu")))
    ]
    assert draws[0] == draws[1]


def test_processors_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={4: 1.5},
        min_tokens=3,
        stop_token_ids=[2],
    )
    row = SamplingRow(params, None, prompt_ids=[0], output_ids=[1, 1], eos_ids=[3])
    out = apply_processors(logits, [row])[0]
    # token 0: seen in prompt, positive -> /2; token 1: seen, negative -> *2, then counts 2
    # tokens 2 (stop id) and 3 (eos) blocked while fewer than min_tokens outputs; token 4: +1.5
    expected = torch.tensor([1.0, -2.0 - 0.25 * 2 - 0.5, float("-inf"), float("-inf"), -0.5])
    assert torch.equal(out, expected)
    row.output_ids = [1, 1, 1]  # min_tokens reached: stop id and EOS are free again
    out = apply_processors(logits, [row])[0]
    assert out[2] == 0.5 and out[3] == 3.0


def _bias_by_loop(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The definition: each entry added on its own, then min_tokens and penalties as usual."""
    out = logits.float().clone()
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias.items():
            out[i, token] += bias
    plain = [
        SamplingRow(
            dataclasses.replace(r.params, logit_bias={}),
            None,
            r.prompt_ids,
            r.output_ids,
            r.eos_ids,
        )
        for r in rows
    ]
    return apply_processors(out, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logit_bias_tensors_equal_the_per_entry_loop(dtype):
    """Bias added as one index_add_ per row gives bit for bit the per-entry additions, in a
    batch with rows of other biases, none, and penalties after it."""
    gen = torch.Generator().manual_seed(3)
    vocab = 500
    logits = (torch.randn(4, vocab, generator=gen) * 10).to(dtype)
    ids = torch.randperm(vocab, generator=gen)
    big = {int(t): float(v) for t, v in zip(ids[:480], torch.randn(480, generator=gen) * 50, strict=True)}
    params = [
        SamplingParams(logit_bias=big, max_tokens=8, min_tokens=4, stop_token_ids=[int(ids[0])]),
        SamplingParams(),
        SamplingParams(logit_bias={7: 1e39, 9: -0.1}, repetition_penalty=1.7, frequency_penalty=0.5),
        SamplingParams(logit_bias={int(ids[1]): 3.0}, presence_penalty=-1.0),
    ]
    rows = [SamplingRow(p, None, [1, 2, 3], [4, 4, int(ids[0])], [5]) for p in params]
    expected = _bias_by_loop(logits, rows)
    assert torch.equal(apply_processors(logits, rows), expected)
    assert torch.equal(apply_processors(logits, rows), expected)  # the tensors are reused


def test_the_per_entry_loop_check_can_fail():
    """The comparison above sees a bias that lands on the wrong token."""
    logits = torch.zeros(1, 10)
    row = SamplingRow(SamplingParams(logit_bias={3: 1.0}), None, [], [], [])
    row.bias = (torch.tensor([4]), torch.tensor([1.0]))
    assert not torch.equal(apply_processors(logits, [row]), _bias_by_loop(logits, [row]))


def test_seeded_rows_ignore_their_neighbours():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=11)

    def draws(batch_rows: int) -> list[int]:
        gen = make_generator(params, torch.device("cpu"))
        others = [
            SamplingRow(
                SamplingParams(temperature=1.0),
                make_generator(SamplingParams(), torch.device("cpu")),
                [],
                [],
                [],
            )
        ]
        tokens = []
        for position in range(30):
            rows = others * batch_rows + [SamplingRow(params, gen, [], [], [])]
            positions = [7 + position] * batch_rows + [position]
            tokens.append(
                sample(logits[:1].expand(len(rows), -1).contiguous(), rows, positions=positions)[-1]
            )
        return tokens

    assert draws(0) == draws(2)
    assert len(set(draws(0))) > 1  # the positions draw different tokens


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    vocab=st.integers(1, 3000),
    levels=st.integers(1, 4),
    nans=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_greedy_tokens_are_argmax_with_ties_and_nans(rows, vocab, levels, nans, seed, dtype):
    """``greedy_tokens`` is the engine's argmax: the first maximum on ties (few distinct values
    make many), a NaN taken as the maximum, at any row count and vocabulary size, on NumPy's
    path (fp32, fp64) and ATen's (bf16)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=g).to(dtype)
    logits[torch.randint(0, rows, (nans,), generator=g), torch.randint(0, vocab, (nans,), generator=g)] = (
        math.nan
    )
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_greedy_tokens_check_can_fail():
    """The mutation check: a greedy rule taking the last maximum instead of the first fails the
    property's comparison with ``argmax`` on a tie."""
    logits = torch.tensor([[0.0, 2.0, 2.0]])
    last = logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)
    assert not torch.equal(last, logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def _uniformity_chi_square(uniforms: np.ndarray, bins: int = 64) -> float:
    counts = np.bincount(np.minimum((uniforms * bins).astype(np.int64), bins - 1), minlength=bins)
    expected = len(uniforms) / bins
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("broken", [None, "position ignored", "low bits"])
def test_keyed_uniforms_are_uniform_and_independent(broken, monkeypatch):
    """The draw's uniforms over consecutive positions of one seed, and over consecutive seeds
    at one position, pass a chi-square test of uniformity, and pairs of neighbouring seeds
    are uncorrelated. Mutation checks: a key that drops the position, or a uniform from the
    hash's low bits of a weak mix, is caught."""
    from deepinfer.sampling import sampler

    if broken == "position ignored":
        real = sampler.draw_uniforms
        monkeypatch.setattr(sampler, "draw_uniforms", lambda seeds, positions: real(seeds, [0] * len(seeds)))
    elif broken == "low bits":
        monkeypatch.setattr(
            sampler,
            "draw_uniforms",
            lambda seeds, positions: (np.asarray(seeds) * 3 + np.asarray(positions)) % 64 / 64.0,
        )
    n = 8192
    critical = _chi2_critical(63)
    by_position = sampler.draw_uniforms([12345] * n, list(range(n)))
    by_seed = sampler.draw_uniforms(list(range(n)), [5] * n)
    neighbours = sampler.draw_uniforms(list(range(1, n + 1)), [5] * n)
    ok = (
        _uniformity_chi_square(by_position) < critical
        and _uniformity_chi_square(by_seed) < critical
        and abs(np.corrcoef(by_seed, neighbours)[0, 1]) < 4 / np.sqrt(n)
    )
    assert ok == (broken is None)


def test_sampling_reads_nothing_back_from_the_device():
    """The step's tokens stay on the device: ``sample_tokens`` makes no host read or sync
    (greedy, seeded top-p and NaN rows; checked on the value-less meta device)."""
    from capture_guard import META, CaptureGuard

    from deepinfer.sampling.sampler import sample_tokens

    logits = torch.zeros(3, 32, device=META)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), None, [1], [], [0]),
        SamplingRow(
            SamplingParams(temperature=0.8, top_p=0.9, seed=3),
            make_generator(SamplingParams(seed=3), torch.device("cpu")),
            [1],
            [],
            [0],
        ),
        SamplingRow(
            SamplingParams(temperature=1.0, min_p=0.1),
            make_generator(SamplingParams(), torch.device("cpu")),
            [1],
            [2],
            [0],
        ),
    ]
    with CaptureGuard() as found:
        tokens = sample_tokens(logits, rows, [1, 1, 2])
    assert tokens.device == META and tokens.shape == (3,)
    reads = [f for f in found if "host read" in f or "device sync" in f]
    assert not reads, reads


def test_a_host_read_in_sampling_is_caught(monkeypatch):
    """Mutation check of the test above: the old per-row ``int(torch.multinomial(...))``."""
    from capture_guard import META, CaptureGuard

    from deepinfer.sampling import sampler

    monkeypatch.setattr(
        sampler, "draw_from", lambda probs, u: torch.tensor([int(probs.argmax())], device=META)
    )
    logits = torch.zeros(1, 32, device=META)
    row = SamplingRow(
        SamplingParams(temperature=1.0, seed=1),
        make_generator(SamplingParams(seed=1), torch.device("cpu")),
        [1],
        [],
        [0],
    )
    with CaptureGuard() as found:
        try:
            sampler.sample_tokens(logits, [row], [1])
        except Exception:
            pass  # meta tensors cannot be read; the guard saw the attempt first
    assert [f for f in found if "host read" in f or "device sync" in f]
