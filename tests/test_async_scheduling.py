"""Asynchronous scheduling (step N + 1 launched before step N's tokens are read) changes nothing users see:
the same tokens, texts, finish reasons and logprobs as the synchronous engine, whatever ends a sequence
(EOS, stop strings, stop ids, max_tokens, max_model_len, abort), with prefix caching, preemption, n > 1,
min_tokens and seeded sampling in the batch."""

from __future__ import annotations

import re

import pytest

from nvllm import SamplingParams
from nvllm.config import ConfigError, EngineConfig
from tests.conftest import make_llm

_STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball.")
PROMPTS = [
    _STORY + " She wanted",
    _STORY + " Her mom said",  # shares whole blocks with the first
    "The cat sat on the mat and",
    "One day, Lily went to the park",
    "Tim had a big red ball",
    "She was very happy",
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0.0),  # ends on EOS or at max_tokens
        SamplingParams(max_tokens=1, temperature=0.0),  # one token: certain to finish on its pending token
        SamplingParams(max_tokens=60, temperature=0.0, stop=["park", "."]),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2),  # seeded: reproducible anywhere
        SamplingParams(max_tokens=25, temperature=0.0, min_tokens=20, logprobs=2),  # a step that reads at once
        SamplingParams(max_tokens=50, temperature=1.0, top_k=20, seed=3, ignore_eos=True, stop_token_ids=[13]),
    ]


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, round(lp.logprob, 5)) for t, lp in d.items())
                                               for d in c.logprobs])
             for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def engines(demo_dir):
    sync = make_llm(demo_dir, async_scheduling=False)
    asyn = make_llm(demo_dir, async_scheduling=True)
    return sync, asyn


def test_same_outputs_as_synchronous(engines):
    sync, asyn = engines
    assert asyn.engine.async_scheduling and not sync.engine.async_scheduling
    want = _summary(sync.generate(PROMPTS, _params(), use_tqdm=False))
    got = _summary(asyn.generate(PROMPTS, _params(), use_tqdm=False))
    assert got == want
    assert not asyn.engine.has_unfinished_requests()
    assert asyn.engine.block_manager.num_free_blocks == asyn.engine.block_manager.num_blocks
    # a second run hits the prefix cache the first one filled: the blocks were hashed with real tokens
    again = _summary(asyn.generate(PROMPTS, _params(), use_tqdm=False))
    assert again == want
    assert asyn.engine.block_manager.prefix_hits > 0


def test_steps_really_overlap(engines):
    """Between two decode steps a step is in flight: the next one was launched before its tokens were read."""
    _, asyn = engines
    e = asyn.engine
    e.add_request("overlap", "Once upon a time", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seen_inflight = 0
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()
        seen_inflight += e._inflight is not None
        seq = e.requests.get("overlap", [None])[0]
        if seq is not None:  # what users see never holds a placeholder
            assert all(t >= 0 for t in seq.output_token_ids)
    assert seen_inflight >= 6
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8


def test_max_model_len_and_preemption(demo_dir):
    """A small pool forces preemptions of sequences with a token still pending; a short max_model_len ends
    sequences by length, never computing a position past it."""
    prompts = [p + " and then" for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    kw = dict(max_model_len=64, num_kv_blocks=12, block_size=8, max_num_seqs=8)
    sync = make_llm(demo_dir, async_scheduling=False, **kw)
    asyn = make_llm(demo_dir, async_scheduling=True, **kw)
    furthest = {}
    for name, llm in (("sync", sync), ("async", asyn)):
        def checked(scheduled, *args, _execute=llm.engine.runner.execute, _name=name, **kw):
            furthest[_name] = max(furthest.get(_name, 0), *(seq.num_computed_tokens + n for seq, n in scheduled))
            return _execute(scheduled, *args, **kw)

        llm.engine.runner.execute = checked
    want = _summary(sync.generate(prompts, params, use_tqdm=False))
    got = _summary(asyn.generate(prompts, params, use_tqdm=False))
    assert got == want
    # a sequence certain to end on its pending token is held out: no position past what the synchronous engine
    # computes (the last token of a full-length sequence is sampled, never computed)
    assert furthest["async"] == furthest["sync"] == 63
    assert all(c[2] == "length" for o in got for c in o)
    assert asyn.engine.scheduler.num_preemptions > 0


def test_abort_with_a_step_in_flight(engines):
    _, asyn = engines
    e = asyn.engine
    free = e.block_manager.num_free_blocks
    e.add_request("keep", "Tim had a big red ball", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    e.add_request("drop", "She was very happy", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        e.step()
    assert e._inflight is not None
    out = e.abort_request("drop")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert all(t >= 0 for t in out.outputs[0].token_ids)
    done = []
    while e.has_unfinished_requests():
        done += [o for o in e.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"] and len(done[0].outputs[0].token_ids) == 12
    assert e.block_manager.num_free_blocks == free


def test_config_checks(demo_dir):
    assert EngineConfig(model=demo_dir, device="cpu").async_scheduling is False
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(model=demo_dir, device="cpu", async_scheduling=True, speculative="k=2,method=ngram")
    with pytest.raises(ConfigError, match="one rank"):
        EngineConfig(model=demo_dir, device="cpu", async_scheduling=True, tensor_parallel_size=2)


def test_generated_blocks_hashed_with_real_tokens(demo_dir):
    """Blocks completed by a token the host had not read yet are hashed once it is known: a follow-up prompt that
    repeats the whole conversation finds as many cached tokens as with the synchronous engine."""
    got = {}
    for mode in (False, True):
        llm = make_llm(demo_dir, async_scheduling=mode, block_size=8)
        first = llm.generate([_STORY], SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0]
        follow = list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + [13]
        again = llm.generate([follow], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
        got[mode] = again.num_cached_tokens
    assert got[True] == got[False] > 40


def test_placeholders_resolve_on_the_device():
    """A decode step whose every input is its own row's placeholder takes the previous step's tokens as they are
    (a view: nothing copied to the device between the steps); any other mix gathers them — the same ids either
    way."""
    import torch

    from nvllm.engine.inflight import resolve_placeholders

    prev = torch.tensor([11, 22, 33, 44])
    fast = resolve_placeholders([-1, -2, -3], prev, prev.device)
    assert fast.tolist() == [11, 22, 33] and fast.data_ptr() == prev.data_ptr()
    assert resolve_placeholders([-2, -1], prev, prev.device).tolist() == [22, 11]             # rows reordered
    assert resolve_placeholders([-1, 7, -3], prev, prev.device).tolist() == [11, 7, 33]       # a host id among them
    assert resolve_placeholders([-1, -2, -3, -4], prev, prev.device).tolist() == [11, 22, 33, 44]


def test_penalties_count_the_token_still_in_flight(engines, monkeypatch):
    """A penalized sequence is sampled while its newest token is still on the device (the step before has not been
    read): the sampler takes it from there, so every output is the synchronous engine's. The first request shows it
    plainly: a token forced by logit_bias +100 comes first, then a repetition penalty of 1000 keeps it out — a
    penalty that missed the newest token would let it come straight back."""
    sync, asyn = engines
    forced = 13
    greedy = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(**greedy, logit_bias={forced: 100.0}, repetition_penalty=1000.0),
              SamplingParams(**greedy, frequency_penalty=2.0),
              SamplingParams(**greedy, presence_penalty=2.0, repetition_penalty=1.5),
              SamplingParams(**greedy)]
    prompts = PROMPTS[2:6]
    want = [o.outputs[0].token_ids for o in sync.generate(prompts, params, use_tqdm=False)]
    assert want[0][0] == forced and want[0].count(forced) == 1
    sampler = asyn.engine.runner.sampler
    real, in_flight = sampler.sample, []

    def spy(logits, rows, pending=None):
        in_flight.append(pending is not None and any(r.token_ids is not None and min(r.token_ids) < 0 for r in rows))
        return real(logits, rows, pending)

    monkeypatch.setattr(sampler, "sample", spy)
    got = [o.outputs[0].token_ids for o in asyn.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sum(in_flight) >= 20  # the penalized rows really were sampled with their newest token unread


def test_constrained_sequences_overlap_too(engines, monkeypatch):
    """A constrained sequence's mask needs its newest token: the step in flight is read once the next step's forward
    is queued, and the rows are made after. Outputs are the synchronous engine's, also where a constraint completes
    on the token read late (the step launched meanwhile samples that sequence for nothing)."""
    from nvllm import StructuredOutputsParams as S

    sync, asyn = engines
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=S(regex=r"(Lily|Tom)( [a-z]+){2,6}\.")),
              SamplingParams(max_tokens=30, temperature=0.9, seed=4, n=2, structured_outputs=S(choice=["yes", "no"])),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=1.0,
                             structured_outputs=S(json={"type": "object"}, disable_any_whitespace=True))]
    prompts = PROMPTS[2:6]
    counted = [e.engine.stats.prompt_tokens for e in engines]
    want = _summary(sync.generate(prompts, params, use_tqdm=False))
    runner, late = asyn.engine.runner, []
    real = runner.execute

    def spy(scheduled, sample_rows, **kw):
        late.append(callable(sample_rows) and kw.get("defer", False))
        return real(scheduled, sample_rows, **kw)

    monkeypatch.setattr(runner, "execute", spy)
    got = _summary(asyn.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert sum(late) >= 10  # constrained steps launched with the step before still in flight
    sync_count, async_count = (e.engine.stats.prompt_tokens - c for e, c in zip(engines, counted))
    assert async_count == sync_count == sum(len(o.prompt_token_ids) * p.n for o, p in zip(
        sync.generate(prompts, params, use_tqdm=False), params))
    assert asyn.engine.block_manager.num_free_blocks == asyn.engine.block_manager.num_blocks


def test_a_reasoning_block_closed_by_a_token_read_late(demo_dir):
    """The token that closes the reply's reasoning block is still in flight when the next step is launched: that
    step's row is made after reading it, so it is already constrained (a +100 bias on ">" shows it)."""
    from nvllm import StructuredOutputsParams as S

    llm = make_llm(demo_dir, async_scheduling=True, reasoning_parser="deepseek_r1")
    engine, tok = llm.engine, llm.get_tokenizer()
    gt = tok.encode("</think>", add_special_tokens=False)[-1]
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={gt: 100.0},
                            structured_outputs=S(regex="[0-9]{3}"))
    rid = engine.add_request(None, "Once upon a time", params)
    seq = engine.requests[rid][0]
    for t in tok.encode(" Let me see.</think", add_special_tokens=False):  # the reply so far, as if drawn
        engine._append_token(seq, t, None, 0.0)
    engine.step()  # the prefill: its token (">", which closes the block) stays on the device
    assert seq.pending == 1 and seq.grammar_waits
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    out = outs[0].outputs[0]
    assert re.fullmatch(r"\s*Let me see\.</think>[0-9]{3}", out.text), out.text
    assert out.finish_reason == "stop"


def test_a_step_that_raises_leaves_nothing_unfinished(engines):
    """A step raising mid-generate (a device error) aborts the call's requests: no block stays taken, nothing counts
    as unfinished (the step launched before it had no one left to read it for), and the next call runs as before."""
    _, asyn = engines
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # no logprobs: every step deferred
    want = _summary(asyn.generate(PROMPTS, params, use_tqdm=False))
    engine, calls = asyn.engine, []
    execute = engine.runner.execute

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("device error")
        return execute(*args, **kwargs)

    engine.runner.execute = failing
    try:
        with pytest.raises(RuntimeError, match="device error"):
            asyn.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.runner.execute = execute
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert _summary(asyn.generate(PROMPTS, params, use_tqdm=False)) == want
