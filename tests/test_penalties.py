"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias: their validation."""

from __future__ import annotations

import pytest

from nvllm import SamplingParams


# ---- the parameters ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number greater than 0, got 0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys must be non-negative integer token ids, got '5'"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be"),
    (dict(logit_bias={True: 1.0}), "logit_bias keys must be"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values must be numbers"),
    (dict(logit_bias={5: "x"}), "logit_bias values must be numbers"),
    (dict(logit_bias=[5]), "logit_bias must be a dict"),
])
def test_bad_values_name_their_parameter(kw, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    text = str(e.value)
    assert text.startswith(next(iter(kw))) and message in text and "\n" not in text


def test_neutral_values_and_clamping():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, None)
    assert not p.penalized and p.unsupported_with_speculation() is None
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 250, 4: -1e9, 5: 0.5}).logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01).penalized
