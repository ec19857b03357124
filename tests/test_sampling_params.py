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
    ],
)
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_values_are_accepted():
    p = SamplingParams(max_tokens=3, temperature=0, top_p=0.5, top_k=0, seed=1, stop_token_ids=(4, 5))
    assert p.greedy and p.stop_token_ids == [4, 5]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
