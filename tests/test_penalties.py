"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias: the sampler's math against HF
transformers' RepetitionPenaltyLogitsProcessor and OpenAI's documented formula, and their validation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nvllm import SamplingParams
from nvllm.layers import sampler as sampler_module
from nvllm.layers.penalties import token_counts
from nvllm.layers.sampler import Sampler, SampleRow

VOCAB = 50
PROMPT = "Once upon a time"


def _row(params: SamplingParams, prompt: list[int] = (), output: list[int] = ()) -> SampleRow:
    ids = list(prompt) + list(output) if params.penalized else None
    return SampleRow(params, None, [], ids, len(prompt))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def _reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row as vLLM defines it, from independent pieces: the bias, then HF's repetition penalty over the prompt
    and the output, then OpenAI's mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty."""
    x = logits.clone()
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), x[None])[0]
    for tok, c in Counter(output).items():
        x[tok] -= c * p.frequency_penalty + p.presence_penalty
    return x


CASES = [  # (params, prompt, output): one batch, each row its own settings
    (_greedy(repetition_penalty=1.3), [3, 5, 7], [5, 9, 9]),
    (_greedy(frequency_penalty=0.7, presence_penalty=0.4), [1, 2], [4, 4, 4, 8, 2]),  # 2 in the prompt: not counted
    (_greedy(), [1, 2, 3], [3, 3, 3]),  # no penalty: untouched
    (_greedy(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.1, logit_bias={9: 3.0, 4: -2.0}),
     [9, 10], [4, 11, 11, 11]),
    (_greedy(logit_bias={0: 100.0, 7: -100.0}), [1], [0]),  # a bias alone needs no history
    (_greedy(repetition_penalty=2.0, presence_penalty=-2.0), [12], []),  # the first token: the prompt only
]


def _logits(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 4  # both signs, so division and multiplication both show


@pytest.mark.parametrize("subset", [range(len(CASES)), [0, 1, 3, 5]], ids=["mixed batch", "every row penalized"])
def test_penalties_match_hf_and_the_openai_formula(subset):
    cases = [CASES[i] for i in subset]
    logits = _logits(0, len(cases))
    want = torch.stack([_reference(logits[i], p, pr, out) for i, (p, pr, out) in enumerate(cases)])
    rows = [_row(p, pr, out) for p, pr, out in cases]
    got = logits.clone()
    tokens = Sampler().sample(got, rows)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert tokens.tolist() == want.argmax(dim=-1).tolist()
    for i, (p, _, _) in enumerate(cases):
        if not p.penalized and not p.logit_bias:
            assert torch.equal(got[i], logits[i])  # bit for bit
        else:
            assert not torch.equal(got[i], logits[i])


def test_placeholders_take_the_token_still_on_the_device():
    """A row whose newest tokens are placeholders −1 − r (sampled by the step in flight) counts row r of the pending
    tokens: the same logits as with the tokens known."""
    p = _greedy(frequency_penalty=1.5, repetition_penalty=1.4)
    known = [_row(p, [1, 2], [6, 13]), _row(p, [3], [13, 13, 22])]
    placeholders = [_row(p, [1, 2], [6, -2]), _row(p, [3], [13, -3, -1])]
    pending = torch.tensor([22, 13, 13, 40])
    logits = _logits(1, 2)
    a, b = logits.clone(), logits.clone()
    Sampler().sample(a, known)
    Sampler().sample(b, placeholders, pending)
    assert torch.equal(a, b) and not torch.equal(a, logits)
    with pytest.raises(RuntimeError, match="pending"):
        Sampler().sample(logits.clone(), placeholders)


def test_token_counts_per_row():
    ids = torch.tensor([4, 4, 1, 0, 4, 2, 2, 2])
    counts = token_counts(ids, [3, 0, 5], 6)
    assert counts.tolist() == [[0, 1, 0, 0, 2, 0], [0] * 6, [1, 0, 3, 0, 1, 0]]


def test_a_batch_without_penalties_builds_nothing_for_them(monkeypatch):
    """The plain path (greedy argmax, or the Gumbel draw) never reaches the penalty code."""
    def forbidden(*a, **k):
        raise AssertionError("penalty code ran for a batch without penalties")

    monkeypatch.setattr(sampler_module, "apply_logit_bias", forbidden)
    monkeypatch.setattr(sampler_module, "apply_penalties", forbidden)
    rows = [_row(_greedy()), _row(SamplingParams(temperature=0.7, top_k=5))]
    assert Sampler().sample(_logits(2, 2), rows).shape == (2,)
    with pytest.raises(AssertionError, match="penalty code"):
        Sampler().sample(_logits(2, 2), rows + [_row(_greedy(logit_bias={1: 1.0}))])


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
