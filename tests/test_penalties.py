"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias: the sampler's math against HF
transformers' RepetitionPenaltyLogitsProcessor and OpenAI's documented formula, then end to end on the demo model
(greedy outputs change as they must, batch invariance, validation). With speculative decoding:
test_spec_sampling_controls.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nvllm import SamplingParams
from nvllm.layers import sampler as sampler_module
from nvllm.layers.penalties import token_counts
from nvllm.layers.sampler import Sampler, SampleRow
from tests.conftest import make_llm

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


def test_along_drafts_equals_one_row_per_position():
    """Speculative verification counts each sequence once and adds its drafts per row: the same logits as the
    plain penalties on one row per position holding the sequence's tokens and the drafts before it."""
    from nvllm.layers.penalties import apply_penalties, apply_penalties_along_drafts

    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(), SamplingParams(frequency_penalty=-1.0), SamplingParams(repetition_penalty=0.8)]
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 5, 12, 7)]
    prompts = [4, 5, 3, 7]  # the last sequence has generated nothing yet
    drafts = [[3, 3, 8], [1], [], [seqs[3][0], 2]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=gen)
    per_position = [SampleRow(p, None, [], [*ids, *d[:j]] if p.penalized else None, n)
                    for p, ids, n, d in zip(params, seqs, prompts, drafts) for j in range(len(d) + 1)]
    want = logits.clone()
    apply_penalties(want, per_position)
    got = logits.clone()
    apply_penalties_along_drafts(got, [SampleRow(p, None, [], ids if p.penalized else None, n)
                                       for p, ids, n in zip(params, seqs, prompts)], drafts)
    assert torch.equal(got, want) and not torch.equal(got, logits)


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
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number greater than 0 within float32's range "
     "[1.18e-38, 3.4e+38], got 0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be"),
    (dict(repetition_penalty=1e-40), "repetition_penalty must be"),  # 0 or a subnormal once in float32
    (dict(repetition_penalty=1e39), "repetition_penalty must be"),  # inf in float32
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
    assert not p.penalized
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 250, 4: -1e9, 5: 0.5}).logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01).penalized


def test_a_penalty_far_from_one_keeps_the_logits_finite():
    """Dividing by 2e-38 takes a logit of 10 past float32's range: it stays the largest finite value (+inf would
    make the softmax NaN and the draw ignore allowed_token_ids); banned tokens stay −inf."""
    logits = torch.full((1, VOCAB), -3.0)
    logits[0, 5], logits[0, 9] = 10.0, 9.0
    p = SamplingParams(temperature=1.0, seed=0, repetition_penalty=2e-38, allowed_token_ids=[5, 9])
    got = logits.clone()
    token = Sampler().sample(got, [_row(p, prompt=list(range(VOCAB)))])
    big = torch.finfo(torch.float32).max
    assert got[0, 5] == big and got[0, 9] == big and not got.isnan().any()
    assert token.item() in (5, 9)


# ---- end to end on the demo model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(demo_dir):
    return make_llm(demo_dir)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0),
                                dict(presence_penalty=1.5)])
def test_penalties_reduce_repeated_tokens(llm, kw):
    plain = _tokens(llm, [PROMPT], _greedy(max_tokens=60, ignore_eos=True))[0]
    penalized = _tokens(llm, [PROMPT], _greedy(max_tokens=60, ignore_eos=True, **kw))[0]
    assert penalized != plain and len(penalized) == 60
    assert _repeats(penalized) < _repeats(plain)


def test_logit_bias_bans_and_forces_tokens(llm):
    plain = _tokens(llm, [PROMPT], _greedy(max_tokens=30))[0]
    first = plain[0]
    banned = _tokens(llm, [PROMPT], _greedy(max_tokens=30, logit_bias={first: -100}))[0]
    assert first not in banned and banned
    forced_id = llm.get_tokenizer().encode(" dog", add_special_tokens=False)[-1]
    out = llm.generate([PROMPT], _greedy(max_tokens=8, ignore_eos=True, logit_bias={forced_id: 100}, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced_id] * 8
    # logprobs stay the raw distribution's (vLLM's raw_logprobs): the forced token was not the model's choice
    assert out.logprobs[0][forced_id].rank > 1 and out.logprobs[0][forced_id].logprob < -1.0


def test_batch_invariance(llm):
    """A penalized request batched with plain ones changes nothing for them, and is itself as when alone."""
    plain = _greedy(max_tokens=30, ignore_eos=True)
    pen = _greedy(max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                  presence_penalty=0.3, logit_bias={13: -5.0})
    prompts = ["Tim had a big red ball", PROMPT, "She was very happy"]
    alone = [_tokens(llm, [p], q)[0] for p, q in zip(prompts, (plain, pen, plain))]
    assert _tokens(llm, prompts, [plain, pen, plain]) == alone
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=20, frequency_penalty=1.0)
    alone_sampled = _tokens(llm, ["The dog"], sampled)
    assert _tokens(llm, ["The dog", PROMPT], [sampled, plain])[:1] == alone_sampled


def test_out_of_vocabulary_bias_refused(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"^logit_bias token id {vocab} is outside the vocabulary"):
        llm.generate([PROMPT], _greedy(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
