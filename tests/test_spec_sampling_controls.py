"""Speculative decoding honours what shapes each position's distribution: the presence / frequency / repetition
penalties (counting the drafts before the position), logit_bias, min_tokens and structured outputs (the matcher
advanced through the drafts). Greedy outputs are those of plain decoding with the same settings, sampled ones
follow the penalized target (χ² against a reference computed here from the raw logprobs), and a constraint that
begins inside a verified run (a reasoning block closed there) draws the rest of the run again under it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nvllm import SamplingParams, StructuredOutputsParams as S
from tests.conftest import make_llm
from tests.test_spec_decode import first_two_chi2, spec_of, truncated_copy
from tests.test_spec_units import CHI2_999

PROMPTS = ["Once upon a time", "Lily had a ball. She loved the ball. She", "Tom the dog was happy"]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    return {"truncated": str(truncated_copy(tmp_path_factory.mktemp("drafts") / "t4", 4))}


@pytest.fixture(scope="module")
def plain(demo_dir):
    return make_llm(demo_dir)


def tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **kw)


BATCH = [greedy(repetition_penalty=1.5), greedy(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={13: -5.0}),
         greedy()]


@pytest.mark.parametrize("draft", ["ngram", "truncated"])
def test_greedy_penalties_and_bias_as_without_speculation(draft, drafts, plain, demo_dir):
    """Each request of a mixed batch (penalized, biased, plain) gets plain decoding's tokens."""
    spec = make_llm(demo_dir, speculative=spec_of(draft, drafts, 3))
    want = tokens(plain, PROMPTS, BATCH)
    assert want[0] != tokens(plain, PROMPTS[:1], greedy())[0]  # the penalty changes the reply
    assert tokens(spec, PROMPTS, BATCH) == want
    s = spec.engine.stats.spec
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0


def test_sampled_penalized_tokens_follow_the_penalized_target(drafts, plain, demo_dir):
    """The joint law of the first two tokens under frequency and presence penalties and a bias (the second token's
    penalties count the first), computed from the model's raw logprobs with OpenAI's formula."""
    temperature, n = 2.0, 1500
    tok = plain.get_tokenizer()
    prompt_ids = tok.encode("Lily had a ball. She loved the ball. She")
    vocab = plain.engine.vocab_size
    raw = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)

    def law(ids, bias, penalized_token=None):
        lp = plain.generate({"prompt_token_ids": ids}, raw, use_tqdm=False)[0].outputs[0].logprobs[0]
        x = torch.tensor([lp[t].logprob for t in range(vocab)]) + bias
        if penalized_token is not None:
            x[penalized_token] -= 1.5 * 1 + 0.5  # frequency 1.5 × one occurrence + presence 0.5
        top = x.topk(3)
        return dict(zip(top.indices.tolist(), (top.values / temperature).softmax(0).tolist()))

    bias = torch.zeros(vocab)
    first = law(prompt_ids, bias)
    boosted = sorted(first, key=first.get)[0]  # the least likely of the three, made likelier
    bias[boosted] = 1.0
    joint = {(a, b): pa * pb for a, pa in law(prompt_ids, bias).items()
             for b, pb in law(prompt_ids + [a], bias, a).items()}
    params = SamplingParams(temperature=temperature, top_k=3, max_tokens=4, n=n, seed=1000, ignore_eos=True,
                            frequency_penalty=1.5, presence_penalty=0.5, logit_bias={boosted: 1.0})
    spec = make_llm(demo_dir, speculative=spec_of("truncated", drafts, 2))
    outs = spec.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs
    assert first_two_chi2(outs, joint) < CHI2_999[8]
    s = spec.engine.stats.spec
    assert s.num_drafts >= n // 5 and 0.05 < s.acceptance_rate < 0.95


CONSTRAINTS = [S(regex=r"(Lily|Tom)( [a-z]+){4,8}\."), S(choice=["the dog", "the big red ball", "a cat"]),
               S(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                       "required": ["name"]}, disable_any_whitespace=True)]


@pytest.mark.parametrize("draft", ["ngram", "truncated"])
def test_greedy_constrained_outputs_as_without_speculation(draft, drafts, plain, demo_dir):
    """Drafts the grammar refuses are rejected; min_tokens still yields to a complete constraint."""
    spec = make_llm(demo_dir, speculative=spec_of(draft, drafts, 3))
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in CONSTRAINTS]
    params.append(SamplingParams(temperature=0, max_tokens=40, min_tokens=10, structured_outputs=CONSTRAINTS[1]))
    prompts = PROMPTS + PROMPTS[:1]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["stop"] * 4
    assert re.fullmatch(r"(Lily|Tom)( [a-z]+){4,8}\.", got[0].text) and got[1].text in CONSTRAINTS[1].choice
    assert json.loads(got[2].text)["name"] and got[3].text in CONSTRAINTS[1].choice
    assert spec.engine.stats.spec.num_drafts > 0


def test_sampled_constrained_outputs_fit(drafts, demo_dir):
    spec = make_llm(demo_dir, speculative=spec_of("truncated", drafts, 3))
    params = SamplingParams(temperature=1.0, max_tokens=40, n=12, seed=5, structured_outputs=CONSTRAINTS[0])
    outs = spec.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs
    assert all(re.fullmatch(r"(Lily|Tom)( [a-z]+){4,8}\.", o.text) for o in outs), [o.text for o in outs]
    assert spec.engine.stats.spec.num_accepted_tokens > 0


def test_a_constraint_beginning_inside_a_verified_run(demo_dir):
    """The reply closes its reasoning block with the first token of a verified run, whose next token was drawn
    unconstrained: it is dropped and drawn again under the constraint. The reply is led there: it goes on as if
    drawn (as a decode worker receives tokens) up to "</thin"; biases (chosen from the model's logits there) and
    the penalties that count the drafts make the prefill draw "k" and the verification ">", which n-gram lookup
    drafts (the prompt has "</think>>>>>>")."""
    spec = make_llm(demo_dir, speculative="k=3,method=ngram", reasoning_parser="deepseek_r1")
    engine, tok = spec.engine, spec.get_tokenizer()
    k, gt = tok.encode("</think>", add_special_tokens=False)[-2:]
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={k: 50.0, gt: 68.0}, presence_penalty=2.0,
                            frequency_penalty=2.0, structured_outputs=S(regex="[0-9]{3}"))
    rid = engine.add_request(None, "</think>>>>>> Once upon a time", params)
    seq = engine.requests[rid][0]
    for t in tok.encode(" Let me see.</thin", add_special_tokens=False):
        engine._append_token(seq, t, None, 0.0)
    runs = []
    verify = engine.spec.verify
    engine.spec.verify = lambda logits, entries: runs.append(verify(logits, entries)) or runs[-1]
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    out = outs[0].outputs[0]
    assert re.fullmatch(r"\s*Let me see\.</think>[0-9]{3}", out.text), out.text
    assert out.finish_reason == "stop"
    crossing = runs[0][0]  # the first verification: its first token closed the block, and it emitted more
    assert crossing.token_ids[0] == gt and crossing.accepted >= 1 and len(crossing.token_ids) >= 2
    # acceptance counts the drafts kept: of that run's, only the one that closed the block
    assert engine.stats.spec.num_accepted_tokens == 1 + sum(r[0].accepted for r in runs[1:])


def test_benchmark_mode_accepts_no_draft_a_mask_refuses(drafts, demo_dir):
    """synthetic_acceptance accepts drafts by coin flip, but never one the constraint (or a ban) refuses."""
    spec = make_llm(demo_dir, speculative=f"k=3,draft={drafts['truncated']},synthetic_acceptance=1.0")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CONSTRAINTS[0], bad_words=["park"])
    out = spec.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(Lily|Tom)( [a-z]+){4,8}\.", out.text) and "park" not in out.text, out.text
    assert out.finish_reason == "stop" and spec.engine.stats.spec.num_accepted_tokens > 0
