"""Invalid SamplingParams raise ValueError naming the field."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("seed", "abc"),
        ("stop_token_ids", [1, -3]),
        ("stop_token_ids", "1,2"),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e300),
        ("seed", 2**70),
        ("seed", -(2**64)),
    ],
)
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_values_are_accepted():
    p = SamplingParams(max_tokens=3, temperature=0, top_p=0.5, top_k=0, seed=1, stop_token_ids=(4, 5))
    assert p.greedy and p.stop_token_ids == [4, 5]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


@pytest.mark.parametrize("low", [1e-300, 1e-39, 1e-20, 0.0099])
def test_tiny_temperatures_are_raised_to_the_floor(low):
    """vLLM's rule: a temperature in (0, 0.01) becomes 0.01 (dividing by less overflows)."""
    assert SamplingParams(temperature=low).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.02).temperature == 0.02


def test_logit_bias_is_clamped_to_openais_range():
    p = SamplingParams(logit_bias={1: 1e39, 2: -1e300, 3: 5, 4: -100})
    assert p.logit_bias == {1: 100.0, 2: -100.0, 3: 5.0, 4: -100.0}


def test_logit_bias_has_a_cap_on_entries():
    from deepinfer.sampling_params import MAX_LOGIT_BIAS_ENTRIES

    assert MAX_LOGIT_BIAS_ENTRIES >= 262_144  # every token of the largest vocabulary served
    assert len(SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES), 1.0)).logit_bias) == (
        MAX_LOGIT_BIAS_ENTRIES
    )
    limit = MAX_LOGIT_BIAS_ENTRIES
    with pytest.raises(ValueError, match=rf"^logit_bias may have at most {limit} entries, got {limit + 1}$"):
        SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0))


def test_no_accepted_extreme_makes_a_distribution_nan():
    """The extremes each setting accepts, together, on logits of a wide range: finite."""
    import torch

    from deepinfer.sampling.sampler import INVALID_ROW, SamplingRow, sample

    logits = torch.linspace(-1e4, 1e4, 64).unsqueeze(0)
    for temperature in (1e-300, 0.01, 1e30):
        for penalty in (0.01, 100.0):
            params = SamplingParams(
                temperature=temperature,
                repetition_penalty=penalty,
                logit_bias={0: 1e39, 63: -1e39},
                frequency_penalty=2.0,
                presence_penalty=-2.0,
                seed=0,
            )
            gen = torch.Generator().manual_seed(0)
            row = SamplingRow(params, gen, list(range(64)), [5, 5, 7], [1])
            assert sample(logits, [row])[0] != INVALID_ROW, (temperature, penalty)
