"""Sampling: seeds, top-k / top-p / min-p, frequencies against the softmax, stop conditions, logprobs,
incremental detokenization."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from nvllm import SamplingParams
from nvllm.engine.detokenizer import IncrementalDetokenizer
from nvllm.layers.sampler import Sampler, SampleRow, apply_top_k_top_p_min_p
from tests.conftest import make_llm


@pytest.fixture(scope="module")
def llm(demo_dir):
    return make_llm(demo_dir)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=30)
    a = texts(llm.generate(["Once upon a time"] * 2, p, use_tqdm=False))
    b = texts(llm.generate(["Once upon a time"], p, use_tqdm=False))
    assert a[0] == a[1] == b[0]
    others = texts(llm.generate(["Once upon a time"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=30)
                                                          for s in range(4)], use_tqdm=False))
    assert len(set(others)) > 1


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20)
    alone = llm.generate(["The dog"], p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Lily went", "The dog", "A big"],
                         [SamplingParams(temperature=1.0, max_tokens=25), p, SamplingParams(temperature=0)],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_top_k_never_emits_excluded_tokens(llm):
    p = SamplingParams(temperature=1.5, top_k=3, max_tokens=40, logprobs=3, seed=0)
    for o in llm.generate(["Once upon a time"] * 4, p, use_tqdm=False):
        c = o.outputs[0]
        assert all(lp[t].rank <= 3 for t, lp in zip(c.token_ids, c.logprobs))


def test_top_p_never_emits_excluded_tokens(llm):
    vocab = llm.engine.vocab_size
    p = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=30, logprobs=vocab, seed=3)
    for o in llm.generate(["Tom and Lily", "One day"], p, use_tqdm=False):
        c = o.outputs[0]
        for t, lp in zip(c.token_ids, c.logprobs):
            better = sum(math.exp(v.logprob) for tok, v in lp.items() if v.logprob > lp[t].logprob)
            assert better < 0.5 + 1e-6


def test_sampled_frequencies_match_softmax():
    """20 000 draws from fixed logits: chi-square against softmax(logits / T) with and without top-k."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    n, temp = 20000, 0.8
    sampler = Sampler(seed=11)
    rows = [SampleRow(SamplingParams(temperature=temp), None, [])] * n
    counts = torch.bincount(torch.tensor(sampler(logits.repeat(n, 1), rows).token_ids), minlength=8).double()
    expected = torch.softmax(logits / temp, -1).double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.32  # 99.9% quantile of chi-square with 7 degrees of freedom

    rows = [SampleRow(SamplingParams(temperature=temp, top_k=3), None, [])] * n
    counts = torch.bincount(torch.tensor(sampler(logits.repeat(n, 1), rows).token_ids), minlength=8).double()
    assert counts[3:].sum() == 0
    expected = torch.softmax(logits[:3] / temp, -1).double() * n
    chi2 = ((counts[:3] - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.82  # 99.9% quantile, 2 degrees of freedom


def test_greedy_argmax_kernel_matches_torch(monkeypatch):
    """The one-launch greedy argmax under the interpreter against ``torch.argmax``: rows wider than one block and
    not a multiple of it, a tie across blocks (the lowest index), an all −inf row, NaN (the largest), bf16 logits,
    a strided row set, and launch after launch on the same ticket counters; the sampler's greedy rows take it and
    the kernel report says so."""
    from nvllm.kernels import argmax as A, report

    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2 * A.BLOCK + 123, generator=g)
    x[1, 5] = x[1, A.BLOCK + 7] = 40.0                    # the same max in two blocks
    x[2] = float("-inf")
    x[3, 3 * A.BLOCK // 2] = float("nan")
    x[3, 2 * A.BLOCK + 100] = float("nan")
    x[3, 10] = float("inf")
    for logits in (x, x.bfloat16(), x[:, :A.BLOCK + 1], torch.randn(3, 64, generator=g)):
        for _ in range(2):
            assert A.greedy_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert A.greedy_argmax(x).tolist() == [int(x[0].argmax()), 5, 0, 3 * A.BLOCK // 2]
    report.reset()
    rows = [SampleRow(SamplingParams(temperature=0), None, [])] * 4
    assert Sampler(seed=0).sample(x.clone(), rows).tolist() == x.argmax(dim=-1).tolist()
    assert report.snapshot()["sampler"] == {"triton greedy argmax": 1}
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    assert not A.argmax_kernel_fits(x)


def test_gumbel_argmax_kernel_matches_its_reference(monkeypatch):
    """Gumbel-max in one launch under the interpreter: with the same Exp(1) noise it picks the reference's token
    (``argmax(softmax(scale · x) / noise)``), one scale for all rows or one per row, masked (−inf) tokens never."""
    from nvllm.kernels import argmax as A

    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, A.BLOCK + 300, generator=g) * 3
    x[2, : A.BLOCK] = float("-inf")                        # only the second block may be drawn
    noise = torch.empty_like(x).exponential_(generator=g)
    for scale in (1.0, 1 / 0.7, torch.tensor([1.0, 2.0, 0.5, 1.3, 1.0, 4.0])):
        got = A.gumbel_argmax(x, noise, scale)
        assert got.tolist() == A.gumbel_argmax_reference(x, noise, scale).tolist()
        assert int(got[2]) >= A.BLOCK


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_sampler_draws_follow_the_softmax_on_both_paths(kernels, monkeypatch):
    """The sampler's draws at temperature 0.8, with and without top-k, in a batch that mixes in greedy rows: the
    frequencies against softmax(logits / T) (chi-square), the greedy rows their argmax, on the torch path and on
    the Gumbel-max kernel's (interpreter); the kernel report names the path."""
    from nvllm.kernels import report

    monkeypatch.setenv("NVLLM_KERNELS", kernels)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    # the interpreter runs the kernel's 6 ms a row: fewer draws there (a temperature of 1 instead of 0.8 still
    # scores over three times the limit without top-k)
    n, temp = (4000 if kernels == "torch" else 1200), 0.8
    quantile = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # 99.9% chi-square, by dof
    sampler = Sampler(seed=5)
    for top_k in (0, 3):
        rows = [SampleRow(SamplingParams(temperature=temp, top_k=top_k), None, [])] * n
        rows += [SampleRow(SamplingParams(temperature=0), None, [])] * 2
        batch = torch.cat([logits.repeat(n, 1), torch.tensor([[0.0, 5.0] + [0.0] * 6, [9.0] + [0.0] * 7])])
        report.reset()
        got = sampler.sample(batch, rows).tolist()
        assert got[n:] == [1, 0]
        keep = 8 if top_k == 0 else top_k
        counts = torch.bincount(torch.tensor(got[:n]), minlength=8).double()
        assert counts[keep:].sum() == 0
        expected = torch.softmax(logits[:keep] / temp, -1).double() * n
        j = keep - 1  # the unlikely tail pooled into one bin of at least 5 expected draws (the logits descend)
        while expected[j:].sum() < 5:
            j -= 1
        counts = torch.cat([counts[:j], counts[j:keep].sum(0, keepdim=True)])
        expected = torch.cat([expected[:j], expected[j:].sum(0, keepdim=True)])
        assert ((counts - expected) ** 2 / expected).sum().item() < quantile[len(expected) - 1]
        assert report.snapshot()["sampler"] == {("triton gumbel argmax" if kernels == "triton" else "torch"): 1}


def test_top_p_min_p_mask():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: (apply_top_k_top_p_min_p(logits, torch.tensor([kw.get("k", -1)]),  # noqa: E731
                                                 torch.tensor([kw.get("p", 1.0)]),
                                                 torch.tensor([kw.get("m", 0.0)])) > -math.inf)[0].tolist()
    assert keep(p=0.5) == [True, False, False, False]
    assert keep(p=0.6) == [True, True, False, False]
    assert keep(p=0.95) == [True, True, True, False]
    assert keep(m=0.2) == [True, True, True, False]  # 0.05 < 0.2 * 0.5
    assert keep(k=2, p=1.0) == [True, True, False, False]
    # vLLM's order: min-p narrows the distribution before the nucleus is taken over what is left, renormalised
    # (0.5 / 0.8 = 0.625 ≥ 0.6, so the nucleus is the first token alone)
    assert keep(m=0.5, p=0.6) == [True, False, False, False]
    assert keep(m=0.5) == [True, True, False, False]
    # top-k keeps every token tied with the k-th logit, as vLLM masks only logits below it
    tied = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    assert (apply_top_k_top_p_min_p(tied, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
            > -math.inf)[0].tolist() == [True, True, True, True, False]


def test_a_tied_tokens_rank_counts_every_token_at_least_as_likely():
    """vLLM's rank: the number of tokens whose log-probability is >= the chosen one's (itself included)."""
    from nvllm.layers.sampler import batch_token_logprobs
    row = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -1.0, float("-inf")]])
    got = [batch_token_logprobs(row, [t], [0])[0][1] for t in range(6)]
    assert got == [3, 4, 3, 5, 3, 6]


def test_stop_strings_tokens_and_lengths(llm):
    base = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    full = base.outputs[0].text
    assert "Lily" in full
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop=["Lily"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:full.index("Lily")] and out.finish_reason == "stop" and out.stop_reason == "Lily"
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop=["Lily"],
                                                            include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:full.index("Lily") + 4]
    stop_tok = base.outputs[0].token_ids[5]
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.outputs[0].token_ids[:6] and out.stop_reason == stop_tok
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(base.outputs[0].token_ids[:5])  # the stop token's text left out
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_tok],
                                                            include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(base.outputs[0].token_ids[:6])  # ... or kept, as vLLM does
    # vLLM's boundary: with min_tokens = k, the text of the first k tokens is never searched, so a ',' that the
    # k-th token brings is kept even though the k-th token is the last one min_tokens asks for
    ids = base.outputs[0].token_ids
    k = next(i for i in range(1, len(ids) + 1) if "," in tok_text(llm, ids[:i]))
    floor = len(tok_text(llm, ids[:k]))
    at_k = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop=[","], min_tokens=k),
                        use_tqdm=False)[0].outputs[0]
    assert "," in full[floor:] and at_k.text == full[:full.index(",", floor)] and len(at_k.token_ids) > k
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_min_tokens_and_ignore_eos(demo_dir):
    llm = make_llm(demo_dir)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    base = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = base[6]  # make a token greedy decoding reaches the EOS token, as the model's EOS would be
    n = base.index(eos) + 1
    llm.engine.eos_token_ids = {eos}
    c = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    # an end token besides the tokenizer's own (as generation_config.json lists them): its id, as vLLM reports it
    assert c.finish_reason == "stop" and c.stop_reason == eos and c.token_ids == base[:n]
    assert c.text == llm.get_tokenizer().decode(base[:n - 1])  # EOS adds no text
    longer = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 3),
                          use_tqdm=False)[0].outputs[0]
    assert eos not in longer.token_ids[:n + 3] and len(longer.token_ids) >= n + 3
    forced = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == base[:30] and forced.finish_reason == "length"
    # stop strings too wait for min_tokens (vLLM's order): the first ',' comes early and is kept, the next one ends
    text = llm.get_tokenizer().decode(base)
    first = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=[","]),
                         use_tqdm=False)[0].outputs[0]
    assert first.text == text[:text.index(",")] and len(first.token_ids) < 5
    late = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=[","], min_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 5 and late.text.count(",") >= 1 and late.finish_reason in ("stop", "length")
    assert text.startswith(late.text)


def test_end_tokens_stop_reasons_and_min_tokens_as_vllm(demo_dir):
    """The demo model's generation_config.json ends on [2, 1], its tokenizer's EOS is 2: EOS stops with stop_reason
    None, the other end token with its id (vLLM makes it a stop token id). While min_tokens is not reached every end
    token is banned, with ignore_eos too (vLLM's min-tokens processor bans them either way)."""
    llm = make_llm(demo_dir)
    assert llm.get_tokenizer().eos_token_id == 2 and llm.engine.eos_token_ids == {1, 2}
    for tok, reason in ((2, None), (1, 1)):
        c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=5, logit_bias={tok: 100}),
                         use_tqdm=False)[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == ([tok], "stop", reason)
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6, min_tokens=4, ignore_eos=True,
                                                         logit_bias={1: 100, 2: 100}), use_tqdm=False)[0].outputs[0]
    assert not {1, 2} & set(c.token_ids[:4]) and c.token_ids[4:] in ([1, 1], [2, 2]) and c.finish_reason == "length"


def test_a_stop_string_may_begin_in_the_min_tokens_text(demo_dir):
    """vLLM searches from min_tokens on for stops ending in the newer text, so one that begins in the first
    min_tokens tokens' text and ends after it stops the sequence."""
    llm = make_llm(demo_dir)
    ids = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30),
                       use_tqdm=False)[0].outputs[0].token_ids
    k = next(k for k in range(3, 30) if len(tok_text(llm, ids[:k + 1])) - len(tok_text(llm, ids[:k])) >= 2)
    boundary = len(tok_text(llm, ids[:k]))
    text = tok_text(llm, ids[:k + 1])
    stop = text[boundary - 2:boundary + 2]  # two characters on each side of the boundary
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30, stop=[stop], min_tokens=k),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and len(c.token_ids) == k + 1
    assert c.text == text[:text.index(stop, boundary - 2)]


def test_a_stop_string_in_the_first_characters_of_the_output(demo_dir):
    """A stop string ending within the first tokens' text, whatever the text before it (there may be none): the
    search never starts before the text's beginning."""
    from nvllm.engine.stop_checker import find_stop

    assert find_stop(" time", 5, [" time"]) == (0, " time") and find_stop("\n\n", 2, ["\n\n"]) == (0, "\n\n")
    assert find_stop(", there", 6, [" there"]) == (1, " there")
    llm = make_llm(demo_dir)
    full = llm.generate(["Once upon a"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    for stop in (full.text[:3], full.text[1:6], full.text[:8]):
        out = llm.generate(["Once upon a"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop) and out.text == full.text[:full.text.index(stop)]


def tok_text(llm, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids)


def test_n_samples_and_logprobs(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10,
                                                            logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 10
        for t, lp in zip(c.token_ids, c.logprobs):
            assert t in lp and len(lp) <= 3 and lp[t].logprob <= 0
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(out.prompt_token_ids[i] in out.prompt_logprobs[i] for i in range(1, len(out.prompt_token_ids)))


def test_bad_requests_rejected(llm):
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0),
                dict(top_k=-2), dict(min_p=2), dict(stop=["x"] * 65), dict(stop=["x" * 1025])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    for name, value in (("top_k", 1.5), ("max_tokens", 2.5), ("seed", 1.5), ("n", 2.0), ("min_tokens", True),
                        ("logprobs", 1.0), ("stop_token_ids", [2.5]), ("seed", 2 ** 64)):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})
    # vLLM's spellings: seed -1 is no seed (each run draws anew), logprobs True the chosen token's and one more
    assert SamplingParams(seed=-1).seed is None and SamplingParams(logprobs=True, prompt_logprobs=False).logprobs == 1
    # a positive temperature below 0.01 is raised to it and samples (1/T that small overflows), 0 alone is greedy
    tiny = SamplingParams(temperature=1e-6)
    assert tiny.temperature == 0.01 and not tiny.greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=2, logprobs=True), use_tqdm=False)
    assert all(len(lp) >= 1 for lp in out[0].outputs[0].logprobs)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Once upon a time"] + ["a " * 600], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the rejected batch was queued
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 99999]], use_tqdm=False)
    for bad, message in ((torch.tensor([1, 2]), "got Tensor"), ([[1.7, 2]], "integers, got 1.7"),
                         ([["1", "2"]], "integers, got '1'"), ({"text": "x"}, "exactly one of"), (5, "got int")):
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, use_tqdm=False)
    same = llm.generate([{"prompt": "Once upon"}, {"prompt_token_ids": llm.get_tokenizer().encode("Once upon")}],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert same[0].outputs[0].token_ids == same[1].outputs[0].token_ids


def test_detokenizer_never_splits_multibyte(llm):
    tok = llm.get_tokenizer()
    text = "Tom said: café — 東京 ok"
    ids = tok.encode(text)[1:]
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback is exercised
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    pieces = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_outputs_after_a_prompt_ending_in_multibyte_text_read_right(llm):
    """At every split of a text into prompt and output where the prompt ends on a whole character, the output's text
    (incremental, and beam search's) is what the whole text adds after the prompt's: a prompt window that began
    inside a character turned byte-fallback runs into U+FFFD that reached the output."""
    from nvllm.beam_search import _continuation
    from nvllm.engine.detokenizer import prompt_context

    tok = llm.get_tokenizer()
    ids = tok.encode("I like 界好世m and 東京 café ok")[1:]
    decode = functools.partial(tok.decode, skip_special_tokens=True)
    whole, checked = decode(ids), 0
    for k in range(1, len(ids)):
        head = decode(ids[:k])
        if "\ufffd" in head or not whole.startswith(head):
            continue
        detok = IncrementalDetokenizer(tok, ids[:k], skip_special_tokens=True)
        assert "".join(detok.step([i]) for i in ids[k:]) == whole[len(head):], k
        assert _continuation(decode, prompt_context(decode, ids[:k]), ids[k:]) == whole[len(head):], k
        checked += 1
    assert checked > 10


def test_partial_outputs_do_not_change_after_they_are_handed_out(llm):
    eng = llm.engine
    eng.add_request("p", "Once upon a time", SamplingParams(temperature=0, max_tokens=6, logprobs=1))
    first = eng.step()[0]
    n_tokens, n_lps, t_last = len(first.outputs[0].token_ids), len(first.outputs[0].logprobs), \
        first.metrics.last_token_time
    while eng.has_unfinished_requests():
        eng.step()
    assert len(first.outputs[0].token_ids) == n_tokens == n_lps == len(first.outputs[0].logprobs)
    assert first.metrics.last_token_time == t_last and first.metrics.finished_time is None


def test_request_times_in_order(llm):
    """Arrival, first scheduling, first token: the queue time ends when the step is scheduled, before its prefill
    runs (as vLLM stamps it), so a one-chunk prompt's first token comes strictly after its scheduling."""
    m = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].metrics
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.last_token_time
