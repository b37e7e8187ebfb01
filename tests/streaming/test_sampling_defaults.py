"""fishgate.json's `sampling`: absent means Fish's defaults; given fields override them; anything else is refused
with the field, its range and the file named."""

from __future__ import annotations

import pytest

from streaming.sampling_defaults import FISH_SAMPLING, SAMPLING_RANGES, SamplingDefaults


def test_absent_means_fish_defaults_and_given_fields_override() -> None:
    assert SamplingDefaults.from_metadata(None, "f.json") == FISH_SAMPLING == SamplingDefaults(0.7, 0.7, 1.2)
    got = SamplingDefaults.from_metadata({"temperature": 0.4, "top_p": 1}, "f.json")
    assert got == SamplingDefaults(temperature=0.4, top_p=1.0, repetition_penalty=1.2)
    assert isinstance(got.top_p, float)
    assert set(SAMPLING_RANGES) == {"temperature", "top_p", "repetition_penalty"}
    assert FISH_SAMPLING.condition_on_previous_chunks is True  # Fish: each segment sees the previous ones
    alone = SamplingDefaults.from_metadata({"condition_on_previous_chunks": False}, "f.json")
    assert alone == SamplingDefaults(condition_on_previous_chunks=False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([0.4], r"f\.json: 'sampling' must be an object"),
        ({"temp": 0.4}, r"unknown sampling field\(s\) \['temp'\]"),
        ({"temperature": 2.5}, r"sampling\.temperature must be a number in \[0\.0, 2\.0\] \(got 2\.5\)"),
        ({"top_p": 0}, r"sampling\.top_p must be a number in \[0\.01, 1\.0\]"),
        ({"repetition_penalty": "1.2"}, r"sampling\.repetition_penalty must be a number"),
        ({"temperature": True}, r"sampling\.temperature must be a number"),
        ({"temperature": float("nan")}, r"sampling\.temperature must be a number"),
        ({"condition_on_previous_chunks": 0}, r"sampling\.condition_on_previous_chunks must be true or false"),
    ],
)
def test_bad_values_are_refused_with_the_field_and_the_file(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingDefaults.from_metadata(raw, "f.json")


def test_applied_to_replaces_only_the_sampling_fields() -> None:
    from streaming.session import SynthesisSettings

    base = SynthesisSettings(seed=3, max_new_tokens=99)
    got = SamplingDefaults(temperature=0.4, condition_on_previous_chunks=False).applied_to(base)
    assert (got.temperature, got.top_p, got.repetition_penalty) == (0.4, 0.7, 1.2)
    assert got.condition_on_previous_chunks is False
    assert (got.seed, got.max_new_tokens) == (3, 99)
