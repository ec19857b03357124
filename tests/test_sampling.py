"""Sampling is checked statistically against the exact target distribution (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.sampling.sampler import filtered_log_probs, make_generator, sample_token
from deepinfer.sampling_params import SamplingParams


def _chi2_critical(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a normal z (z=4: p ~ 3e-5)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution written out from the definitions (vLLM order: temperature,
    then top-k, then top-p over the renormalised top-k distribution)."""
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
    return target / target.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.8), (0.9, 6, 0.7)],
)
def test_sampled_frequencies_match_the_target_distribution(temperature, top_k, top_p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    gen = make_generator(params, torch.device("cpu"))
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(logits, params, gen) for _ in range(n)]), minlength=12)
    target = _expected(logits, temperature, top_k, top_p)
    support = target > 0
    assert counts[~support].sum() == 0, "sampled a token outside top-k/top-p"
    exp = target[support] * n
    chi2 = (((counts[support].double() - exp) ** 2) / exp).sum().item()
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < _chi2_critical(df), f"chi2={chi2:.1f} df={df}"


def test_filtered_distribution_equals_definition():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    for temperature, top_k, top_p in [(0.5, 10, 0.9), (1.0, -1, 0.3), (2.0, 3, 1.0)]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        got = filtered_log_probs(logits, params).exp().double()
        assert torch.allclose(got, _expected(logits, temperature, top_k, top_p), atol=1e-6)


def test_greedy_is_argmax_and_seed_is_reproducible():
    logits = torch.randn(50)
    assert sample_token(logits, SamplingParams(temperature=0.0), None) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [
        [sample_token(logits, params, g) for _ in range(20)]
        for g in (make_generator(params, torch.device("cpu")), make_generator(params, torch.device("cpu")))
    ]
    assert draws[0] == draws[1]
