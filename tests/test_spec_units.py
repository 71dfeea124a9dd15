"""Speculative decoding's parts without a model: the --speculative parser, the rejection sampler against fixed
distributions (χ²), the acceptance statistics and n-gram proposals, block trimming after verification, and the
CLI option."""

from __future__ import annotations

import pytest
import torch

from nvllm import SamplingParams
from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.block_manager import BlockManager
from nvllm.engine.sequence import Sequence
from nvllm.outputs import RequestMetrics
from nvllm.spec.config import SpeculativeConfig, parse_speculative
from nvllm.spec.metrics import SpecStats
from nvllm.spec.proposer import NgramProposer
from nvllm.spec.rejection_sampler import rejection_sample


# ---- the parser ---------------------------------------------------------------------------------------
def test_parser_forms():
    c = parse_speculative("k=4,draft=/d")
    assert (c.method, c.draft_model, c.num_speculative_tokens, c.auto) == ("draft", "/d", 4, False)
    c = parse_speculative("k=3,method=ngram")
    assert (c.method, c.draft_model, c.num_speculative_tokens) == ("ngram", None, 3)
    c = parse_speculative(" k=auto , draft=/d ")
    assert c.auto and c.num_speculative_tokens == 4
    c = parse_speculative('{"draft_model": "/d", "num_speculative_tokens": 5}')
    assert (c.method, c.draft_model, c.num_speculative_tokens) == ("draft", "/d", 5)
    # one n-gram size given: the other takes its value, as vLLM reads them
    c = parse_speculative({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = parse_speculative({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert parse_speculative({"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
                             ).draft_model == "/d"     # vLLM's examples pass it: the draft runs whole
    assert parse_speculative(None) is None and parse_speculative("") is None
    assert parse_speculative(c) is c
    assert isinstance(EngineConfig(speculative="k=2,method=ngram").speculative, SpeculativeConfig)
    vllm_style = parse_speculative({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3})
    assert (vllm_style.method, vllm_style.draft_model, vllm_style.num_speculative_tokens) == ("draft", "/d", 3)
    # a config dump's nulls leave those options at their defaults
    c = parse_speculative('{"method": "ngram", "num_speculative_tokens": null, "prompt_lookup_min": null, '
                          '"prompt_lookup_max": null, "draft_model": null, "disable_by_batch_size": null}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 1, 3)
    assert parse_speculative({"method": "ngram", "num_speculative_tokens": 3.0}).num_speculative_tokens == 3


@pytest.mark.parametrize("text, message", [
    ("k=4", "needs a draft model"),
    ("k=0,draft=/d", "between 1 and 8"),
    ("k=9,draft=/d", "between 1 and 8"),
    ("k=four,draft=/d", "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2.7}', "must be an integer, got 2.7"),
    ('{"method": "ngram", "prompt_lookup_max": 1.5}', "must be an integer"),
    ('{"num_speculative_tokens": 3, "method": null}', "needs a draft model"),
    ("k=3,method=ngram,draft=/d", "takes no draft model"),
    ("k=4,draft=/d,ngram_max=9", "apply to method=ngram, not to a draft model"),
    ("k=3,method=magic", "unknown"),
    ("k=3,colour=red,method=ngram", "unknown speculative option 'colour'"),
    ("k=3,k=4,method=ngram", "given twice"),
    ("k4,method=ngram", "not key=value"),
    ('{"draft_model": "/d", ', "JSON is malformed"),
    ("k=2,method=ngram,ngram_min=3,ngram_max=2", "prompt_lookup_min <= prompt_lookup_max"),
    ('{"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}', "runs whole on one GPU"),
])
def test_parser_errors(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_speculative(text)


# ---- the rejection sampler on fixed distributions ------------------------------------------------------
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
Q0 = torch.tensor([0.05, 0.10, 0.40, 0.10, 0.15, 0.20])
Q1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.20, 0.10])
CHI2_999 = {1: 10.83, 2: 13.82, 5: 20.52, 8: 26.12}  # 99.9% quantiles of χ² by degrees of freedom


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run_fixed(n: int, q0, q1, seed: int = 0):
    """n requests, each with 2 drafts from q0, q1 and target p0, p1, then a bonus position ~ P0."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([P0, P1, P0]).repeat(n, 1)
    if q0 is None:  # n-gram: a fixed proposal, certain of itself
        d = torch.tensor([2, 5, 0]).repeat(n)
        q = torch.zeros_like(p)
        q[torch.arange(3 * n), d] = 1.0
        q[2::3] = 0.0
    else:
        q = torch.stack([q0, q1, torch.zeros(6)]).repeat(n, 1)
        d = torch.multinomial(q + (q.sum(-1, keepdim=True) == 0), 1, generator=g).squeeze(1)
    acc, final = rejection_sample(p, q, d, p.argmax(-1), [2] * n, [False] * n, [None] * n, g)
    d = d.view(n, 3).tolist()
    emitted = [d[i][:a] + [f] for i, (a, f) in enumerate(zip(acc, final))]
    return acc, emitted


@pytest.mark.parametrize("drafted_from", ["model", "ngram"])
def test_rejection_sampler_emits_the_target_distribution(drafted_from):
    q0, q1 = (Q0, Q1) if drafted_from == "model" else (None, None)
    acc, emitted = run_fixed(20000, q0, q1)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=6).float()
    assert chi2(first, P0) < CHI2_999[5]
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=6).float()
    assert chi2(second, P1) < CHI2_999[5]
    third = torch.bincount(torch.tensor([e[2] for e in emitted if len(e) > 2]), minlength=6).float()
    assert chi2(third, P0) < CHI2_999[5]  # the bonus token
    # acceptance of the first draft: Σ min(p, q) (model) or p(draft) (n-gram)
    rate = sum(a > 0 for a in acc) / len(acc)
    want = float(torch.minimum(P0, Q0).sum()) if q0 is not None else float(P0[2])
    assert abs(rate - want) < 0.015


def test_rejection_sampler_greedy_and_identical_distributions():
    p = torch.stack([P0, P1, P0])
    acc, final = rejection_sample(None, None, torch.tensor([0, 1, 0]), p.argmax(-1), [2], [True], [None],
                                  torch.Generator())
    assert (acc, final) == ([1], [5])  # 0 is P0's argmax; 1 is not P1's (5): the target's argmax replaces it
    acc, final = rejection_sample(p, p.clone(), torch.tensor([3, 4, 0]), p.argmax(-1), [2], [False], [None],
                                  torch.Generator())
    assert acc == [2]  # q == p: always accepted


def test_spec_stats_and_ngram_proposals():
    s = SpecStats()
    for drafted, accepted in [(4, 4), (4, 1), (2, 0), (0, 0)]:
        s.record(drafted, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 10, 5)
    assert s.accepted_per_pos[:4] == [2, 1, 1, 1] and s.acceptance_rate == 0.5
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert s.as_result()["spec_decode_per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    ng = NgramProposer(1, 3)
    assert ng.propose_one([5, 6, 7, 8, 9, 1, 6, 7], 3) == [8, 9, 1]  # suffix 6 7 matched, what followed
    assert ng.propose_one([7, 1, 2, 3, 9, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # the latest full match
    assert ng.propose_one([1, 2, 1, 2, 1, 2], 4) == [1, 2]  # no match has 4 after it: the earliest one
    assert ng.propose_one([1, 2, 3, 4], 2) == []


def test_trim_frees_trailing_blocks_only_once_unshared():
    bm = BlockManager(8, 4)
    s = Sequence("r", 0, list(range(6)), 6, SamplingParams(), RequestMetrics(0.0))
    assert bm.allocate_slots(s, 14)  # 6 tokens + 8 reserved: 4 blocks
    assert len(s.block_table) == 4 and bm.num_free_blocks == 4
    tail = s.block_table[-1]
    bm.blocks[tail].ref_count += 1  # pretend another sequence holds the last block
    s.num_computed_tokens = 5
    bm.trim(s)  # 6 tokens need 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 5 and bm.blocks[tail].ref_count == 1


def test_cli_speculative_option():
    from typer.testing import CliRunner

    from nvllm.cli import app

    res = CliRunner().invoke(app, ["generate", "--max-tokens", "16", "--log-stats-interval", "0", "--device", "cpu",
                                   "--speculative", "k=3,method=ngram"])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "Once upon a time, there was a little girl named Lily" in said and "n-gram lookup" in said
    res = CliRunner().invoke(app, ["generate", "--speculative", "k=3"])
    assert res.exit_code == 2 and "needs a draft model" in res.output


def test_a_draft_whose_kv_cache_does_not_fit_says_so(monkeypatch, demo_dir):
    """The draft's KV cache is as large as the target's: when it does not fit, the message names the draft and the
    block count that would (the allocator's error, now a KVCacheTooLarge, slipped past the draft's own handler)."""
    from types import SimpleNamespace

    from nvllm.engine import model_runner
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.layers.attention import KVCacheTooLarge
    from nvllm.spec import decoder

    def no_room(config, draft=False):
        raise KVCacheTooLarge("a KV cache of 4000 blocks (9.00 GiB) does not fit in cuda:0's memory")

    monkeypatch.setattr(model_runner, "ModelRunner", no_room)
    config = EngineConfig(model=demo_dir, device="cpu", speculative=parse_speculative(f"k=2,draft={demo_dir}"))
    target = SimpleNamespace(num_blocks=4000, kv_bytes_per_token=1024, max_model_len=512,
                             model=SimpleNamespace(shape=SimpleNamespace(vocab_size=512)))
    with pytest.raises(ConfigError, match="no GPU memory left for the draft model and its 4000-block KV cache; "
                                          r"pass --num-kv-blocks \(about \d+\)"):
        decoder.load_draft_runner(config, target, load_tokenizer(demo_dir))
