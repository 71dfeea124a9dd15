"""Speculative decoding on the CPU with models (its model-free parts: test_spec_units.py): greedy
outputs identical with and without speculation for several drafts (with batching, prefix caching and
preemption), sampled outputs distributed as the target's (χ²), stop conditions inside accepted runs, exact
acceptance metrics (stats, log line, /metrics, bench), vocabulary checks and k=auto."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from nvllm import SamplingParams
from nvllm.assets import demo_model_path
from nvllm.config import ConfigError
from nvllm.engine.sequence import Sequence
from nvllm.outputs import RequestMetrics
from nvllm.spec.adaptive import AdaptiveK
from nvllm.spec.config import parse_speculative
from nvllm.spec.draft_chain import MAX_SAMPLED_BATCH, DraftChain
from nvllm.spec.proposer import Drafts
from tests.conftest import build_tiny_model, make_llm
from tests.test_spec_units import CHI2_999, chi2

WORDS = ("Once upon a time there was a little girl named Lily who loved to play in the park with her "
         "big red ball and her friend Tom the dog").split()
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[i % 5: i % 5 + 3 + (5 * i) % 17]) for i in range(n)]


def truncated_copy(dst: Path, layers: int) -> Path:
    """The demo model with only its first `layers` decoder layers: a draft that agrees often, not always."""
    from safetensors.torch import load_file, save_file

    src = Path(demo_model_path())
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    w = load_file(src / "model.safetensors")
    save_file({k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers},
              dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    return {"self": demo_model_path(), "truncated": str(truncated_copy(root / "t4", 4)),
            "random": str(build_tiny_model("llama", root / "random"))}


def spec_of(name: str, drafts: dict[str, str], k: int | str = 4) -> str:
    return f"k={k},method=ngram" if name == "ngram" else f"k={k},draft={drafts[name]}"


def chained(llm, k: int):
    """The engine's draft proposer with a DraftChain (eager over its static buffers, as on the CPU it has no graphs)."""
    proposer = llm.engine.spec.proposer
    proposer.chain = DraftChain(proposer.runner, k, proposer.vocab_size, capture=False)
    return llm


# ---- greedy: identical outputs for every draft, under batching, prefix caching and preemption ----------
@pytest.fixture(scope="module")
def alone(demo_dir):
    llm = make_llm(demo_dir, enable_prefix_caching=False)
    return {p: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts(14)}


@pytest.mark.parametrize("draft", ["self", "truncated", "random", "ngram"])
def test_greedy_identical_with_batching_prefix_caching_preemption(draft, drafts, alone, demo_dir):
    llm = make_llm(demo_dir, block_size=8, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=6,
                   max_model_len=64, speculative=spec_of(draft, drafts))
    ps = prompts(14)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == alone[p], (draft, p)
    e = llm.engine
    assert e.scheduler.num_preemptions > 0 and e.block_manager.prefix_hits + e.block_manager.preempted_hits > 0
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks  # every block came back
    s = e.stats.spec
    assert s.num_drafts > 0
    if draft == "self":
        assert s.acceptance_rate == 1.0
    elif draft == "truncated":
        assert 0.1 < s.acceptance_rate < 0.9
    elif draft == "random":
        assert s.acceptance_rate < 0.1


@pytest.mark.parametrize("draft", ["self", "truncated", "random"])
def test_draft_chain_drafts_what_the_step_by_step_loop_drafts(draft, drafts, alone, demo_dir):
    """The chain (the catch-up and the k drafts as one unit; CUDA graphs on the GPU, here eager over the same static
    buffers) proposes exactly the step-by-step loop's tokens: same outputs, same acceptance counts, under batching,
    prefix caching, preemption and prompt chunks mirrored beside it."""
    kw = dict(block_size=8, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64,
              speculative=spec_of(draft, drafts))
    ps = prompts(14)
    stats = []
    for chained in (False, True):
        llm = make_llm(demo_dir, **kw)
        proposer = llm.engine.spec.proposer
        if chained:
            proposer.chain = DraftChain(proposer.runner, 4, proposer.vocab_size, capture=False)
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in ps], (draft, chained)
        s = llm.engine.stats.spec
        stats.append((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos)))
        assert llm.engine.scheduler.num_preemptions > 0
    assert stats[0] == stats[1]
    assert proposer.chain.runs > 0
    # what the chain takes: sequences drafting at most its k, one or two tokens to catch up, nothing banned
    seq = [Sequence(f"r{i}", 0, list(range(6)), 6, SamplingParams(temperature=0), RequestMetrics(0.0))
           for i in range(2)]
    full = {id(x): 4 for x in seq}
    one, two, three = ([(x, 6 - n, list(range(n))) for x in seq] for n in (1, 2, 3))
    assert proposer._chains(seq, full, one) and proposer._chains(seq, full, two)
    assert not proposer._chains(seq, full, three)  # the draft fell behind: the loop's forward catches it up
    assert proposer._chains(seq, {id(seq[0]): 4, id(seq[1]): 2}, one)  # a k cut near the end: the first 2 drafts
    assert proposer._chains(seq, {id(x): 3 for x in seq}, one)
    assert not proposer._chains(seq, {id(x): 5 for x in seq}, one)
    seq[1].params = SamplingParams(temperature=0, min_tokens=1)
    assert not proposer._chains(seq, full, one)
    seq[1].params = SamplingParams(temperature=0.8, top_p=0.9)  # sampled graphs, up to MAX_SAMPLED_BATCH rows
    assert proposer._chains(seq, full, one)
    many = [Sequence(f"s{i}", 0, list(range(6)), 6, SamplingParams(temperature=0.8), RequestMetrics(0.0))
            for i in range(MAX_SAMPLED_BATCH + 1)]
    assert not proposer._chains(many, {id(x): 4 for x in many}, [(x, 5, [1]) for x in many])
    for x in many:
        x.params = GREEDY
    assert proposer._chains(many, {id(x): 4 for x in many}, [(x, 5, [1]) for x in many])


def test_a_draft_with_fewer_positions_leaves_the_target_its_length(demo_dir, drafts):
    """The random draft takes 256 positions, the target 512: prompts longer than 256 tokens are accepted, sequences
    past the draft's positions decode without drafts (their prompts mirrored into the draft only up to them,
    through block tables cut to its width), and greedy outputs equal plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    tok = make_llm(demo_dir).get_tokenizer()
    long_prompt = tok.decode(tok.encode("Once upon a time there was a little dog. " * 40)[:300])
    ps = [long_prompt, "Once upon a time", "The cat sat"]
    plain = make_llm(demo_dir, block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    want_far = plain.generate(["Lily"], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(demo_dir, block_size=8, max_num_batched_tokens=64, speculative=spec_of("random", drafts, 3))
    assert llm.engine.max_model_len == 512 and llm.engine.spec.draft_limit == 256
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    far = llm.generate(["Lily"], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    assert far[0].outputs[0].token_ids == want_far


def test_draft_chain_runs_to_the_model_length(demo_dir, drafts):
    """Near the end of the model's length (here its max_position_embeddings) the last steps' k is cut: the chain still
    drafts them, and outputs equal plain decoding's. (That the steps after a sequence's last used draft are padding
    rows is checked on the staged buffers, in the test below.)"""
    params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    want = make_llm(demo_dir).generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = chained(make_llm(demo_dir, speculative=spec_of("truncated", drafts, 4)), 4)
    runs = []
    original = llm.engine.spec.proposer.chain.run

    def run(catch_up, starts, tables, params, generators, gen, used):
        runs.append(min(used))  # the fewest drafts a sequence of the step uses
        return original(catch_up, starts, tables, params, generators, gen, used)
    llm.engine.spec.proposer.chain.run = run
    got = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and len(got) + len(llm.get_tokenizer().encode("Once upon a time")) == 512
    assert min(runs) < 4  # the cut steps went through the chain


def test_draft_chain_stages_catch_up_rows_and_padding(demo_dir, drafts):
    """The chain's inputs, as the graphs see them: two catch-up rows per sequence when one has two tokens to catch
    up, the first a padding row (slot −1, context 0) for those with one, else one row each; each step's position, slot and context length from the block table;
    padding sequences store nowhere and attend to nothing."""
    llm = make_llm(demo_dir, block_size=8, speculative=spec_of("self", drafts, 3))
    chain = DraftChain(llm.engine.spec.proposer.runner, 3, 512, capture=False)
    d = chain._split(chain.dev64, chain.dev32, chain.max_batch, 2, 2, chain.width)
    assert (d["cu_slots"] == -1).all() and (d["slots"] == -1).all()  # the capture's warm-up runs store nowhere
    chain.graphs = {1: None, 2: None, 4: None}  # pretend-captured sizes: 3 sequences pad to 4
    assert chain.stage([[7], [8, 9], [5]], [10, 16, 3], [[4, 2], [1, 6, 3], [0]]) == (4, 2, "greedy")
    n = 8
    assert d["cu_ids"][:n].tolist() == [0, 7, 8, 9, 0, 5, 0, 0]
    assert d["cu_pos"][:n].tolist() == [0, 9, 14, 15, 0, 2, 0, 0]
    assert d["cu_slots"][:n].tolist() == [-1, 2 * 8 + 1, 6 * 8 + 6, 6 * 8 + 7, -1, 2, -1, -1]
    assert d["cu_ctx"][:n].tolist() == [0, 10, 15, 16, 0, 3, 0, 0]
    assert d["pos"][:, :4].tolist() == [[10, 16, 3, 0], [11, 17, 4, 0]]
    assert d["slots"][:, :4].tolist() == [[2 * 8 + 2, 3 * 8 + 0, 3, -1], [2 * 8 + 3, 3 * 8 + 1, 4, -1]]
    assert d["ctx"][:, :4].tolist() == [[11, 17, 4, 0], [12, 18, 5, 0]]
    assert d["tables"][:3, :3].tolist() == [[4, 2, 0], [1, 6, 3], [0, 0, 0]]
    # one token each to catch up: the graphs with one catch-up row per sequence
    assert chain.stage([[7], [9]], [10, 16], [[4, 2], [1, 6, 3]]) == (2, 1, "greedy")
    assert d["cu_ids"][:2].tolist() == [7, 9] and d["cu_pos"][:2].tolist() == [9, 15]
    assert d["cu_slots"][:2].tolist() == [2 * 8 + 1, 6 * 8 + 7] and d["cu_ctx"][:2].tolist() == [10, 16]
    # sampled rows: the sampled graphs, each row's temperature, top-p, min-p, top-k and greedy flag; padding greedy
    ps = [SamplingParams(temperature=0.5), GREEDY, SamplingParams(temperature=1.5, top_k=5)]
    assert chain.stage([[7], [9], [1]], [10, 16, 3], [[4, 2], [1, 6, 3], [0]], ps) == (4, 1, "filtered")
    assert chain.params.tolist() == [[0.5, 1.0, 1.5, 1.0] + [0.0] * (chain.params.shape[1] - 4),
                                     [1.0, 1.0, 1.0, 1.0] + [0.0] * (chain.params.shape[1] - 4),
                                     [0.0] * chain.params.shape[1],
                                     [-1.0, -1.0, 5.0, 0.0] + [0.0] * (chain.params.shape[1] - 4),  # -1: off
                                     [0.0, 1.0, 0.0, 1.0] + [0.0] * (chain.params.shape[1] - 4)]
    assert chain.stage([[7]], [10], [[4, 2]], ps[:1]) == (1, 1, "sampled")
    # a sequence using fewer than k drafts (its k cut at the end): the steps after its last used draft are padding,
    # also where their positions would lie past its blocks (position 16 needs a third block)
    assert chain.stage([[7]], [15], [[4, 2]], None, [2]) == (1, 1, "greedy")
    assert d["pos"][:, :1].tolist() == [[15], [0]] and d["slots"][:, :1].tolist() == [[2 * 8 + 7], [-1]]
    assert d["ctx"][:, :1].tolist() == [[16], [0]]
    chain.stage([[7]], [15], [[4, 2]], None, [1])
    assert d["slots"][:, :1].tolist() == [[-1], [-1]] and d["ctx"][:, :1].tolist() == [[0], [0]]


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_tight_token_budget_cuts_drafts(draft, drafts, demo_dir):
    """A budget of 4 tokens: no sequence gets all k = 4 drafted positions, most get fewer (or none)."""
    ps = ["He liked to play with his ball. He liked to play with his ball. He", "The dog", "Lily and Tom",
          "One day, a big cat"]
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, GREEDY, use_tqdm=False)]
    llm = make_llm(demo_dir, max_num_batched_tokens=4, speculative=spec_of(draft, drafts, 4))
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
    s = llm.engine.stats.spec
    assert s.num_drafts > 0 and s.num_draft_tokens < 4 * s.num_drafts


def test_stops_inside_accepted_runs_and_logprobs(demo_dir, drafts):
    """Self-draft accepts everything, so stop strings, stop ids, min_tokens, EOS and max_tokens all fall
    inside accepted runs; the results (and logprobs) must equal plain decoding's."""
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]),
             SamplingParams(temperature=0, max_tokens=30, stop=["park"], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[426], min_tokens=12),
             SamplingParams(temperature=0, max_tokens=13, logprobs=2),
             SamplingParams(temperature=0, max_tokens=400)]  # ends on EOS
    ps = ["Once upon a time", "Once upon a time", "Once upon a time", "The dog", "The dog"]
    plain = make_llm(demo_dir).generate(ps, cases, use_tqdm=False)
    spec = make_llm(demo_dir, speculative=spec_of("self", drafts, 5))
    got = spec.generate(ps, cases, use_tqdm=False)
    for a, b in zip(plain, got):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (cb.text, cb.token_ids, cb.finish_reason, cb.stop_reason) == \
            (ca.text, ca.token_ids, ca.finish_reason, ca.stop_reason)
        if ca.logprobs is not None:
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert [c.outputs[0].finish_reason for c in got] == ["stop", "stop", "stop", "length", "stop"]
    assert spec.engine.stats.spec.num_drafts > 0


# ---- sampling: the target's distribution --------------------------------------------------------------
def joint_first_two(llm, prompt_ids: list[int], temperature: float) -> dict[tuple[int, int], float]:
    """P(t1, t2) under top_k=3 at `temperature`, from the target's own logprobs (plain decoding)."""
    def top3(ids):
        lp = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:3]
        w = torch.tensor([v.logprob for _, v in best]) / temperature
        return dict(zip([t for t, _ in best], w.softmax(0).tolist()))

    return {(a, b): pa * pb for a, pa in top3(prompt_ids).items() for b, pb in top3(prompt_ids + [a]).items()}


def first_two_chi2(outs, joint: dict[tuple[int, int], float]) -> float:
    """χ² of the samples' first two tokens against their joint law (every pair drawn must be one of its keys)."""
    keys = list(joint)
    counts = torch.zeros(len(keys))
    for c in outs:
        counts[keys.index(tuple(c.token_ids[:2]))] += 1
    return chi2(counts, torch.tensor([joint[k] for k in keys]))


@pytest.mark.parametrize("draft", ["none", "truncated", "truncated chained", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(draft, drafts, demo_dir):
    """Also through the draft chain's sampled mode (batches of 8: its sampled graphs' limit)."""
    temperature, n = 2.0, 1500
    plain = make_llm(demo_dir)
    # one of the likely next tokens ("had") occurs earlier in the prompt, so n-gram lookup proposes too
    prompt_ids = plain.get_tokenizer().encode("Lily had a ball. She loved the ball. She")
    joint = joint_first_two(plain, prompt_ids, temperature)
    if draft == "truncated chained":
        llm = chained(make_llm(demo_dir, max_num_seqs=MAX_SAMPLED_BATCH, speculative=spec_of("truncated", drafts, 2)), 2)
    else:
        llm = plain if draft == "none" else make_llm(demo_dir, speculative=spec_of(draft, drafts, 2))
    params = SamplingParams(temperature=temperature, top_k=3, max_tokens=4, n=n, seed=1000, ignore_eos=True)
    outs = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs
    assert first_two_chi2(outs, joint) < CHI2_999[8]
    if draft != "none":  # the second token came out of verification for every sample, some drafts rejected
        s = llm.engine.stats.spec
        assert s.num_drafts >= n // 5 and 0.05 < s.acceptance_rate < 0.95
    if draft == "truncated chained":
        assert llm.engine.spec.proposer.chain.runs >= n // 16  # batches of up to 8: most draws went through it


def test_seeded_requests_reproducible(drafts, demo_dir):
    """A seeded request's output is the same alone or batched while every step drafts k for it, and through the
    draft chain or step by step (the chain draws its noise per step from the request's generator, as the loop
    does). Where the batch cuts a step's k (token budget, free blocks, disable_by_batch_size) the request draws
    from its generator a different number of times: its tokens still follow the target's distribution but are
    not the same; README says so."""
    a = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7)
    b = SamplingParams(temperature=1.0, max_tokens=20, seed=3)
    outs = []
    for chain in (False, True):
        llm = make_llm(demo_dir, speculative=spec_of("truncated", drafts, 3))
        if chain:
            chained(llm, 3)
        alone = llm.generate("Once upon a time", a, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate(["Once upon a time", "The dog"], [a, b], use_tqdm=False)
        assert again[0].outputs[0].token_ids == alone and llm.engine.stats.spec.num_drafts > 0
        assert not chain or llm.engine.spec.proposer.chain.runs > 0
        outs.append([o.outputs[0].token_ids for o in again])
    assert outs[0] == outs[1]


# ---- metrics ------------------------------------------------------------------------------------------
def test_metrics_exact_on_a_self_draft(demo_dir, drafts, caplog):
    from nvllm.bench.serve import spec_decode_stats
    from nvllm.serve.metrics import ServerMetrics

    llm = make_llm(demo_dir, speculative=spec_of("self", drafts, 4), log_stats_interval=3600)
    m = 3  # the prefill emits one token, then each step 4 accepted drafts + the bonus
    log = logging.getLogger("nvllm")  # it does not propagate: listen on it directly
    log.addHandler(caplog.handler)
    try:  # generate() ends with the periodic line, forced
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=1 + 5 * m, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        log.removeHandler(caplog.handler)
    assert len(out.outputs[0].token_ids) == 1 + 5 * m
    s = llm.engine.stats.spec
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (m, 4 * m, 4 * m)
    assert s.accepted_per_pos == [m] * 4 + [0] * 4 and s.mean_acceptance_length == 5.0
    assert llm.engine.stats.num_steps == 1 + m
    line = " ".join(" ".join(r.getMessage() for r in caplog.records).split())
    assert "spec_acceptance: 100.0%, avg_spec_tokens: 5.00, spec_per_position: 1.00/1.00/1.00/1.00" in line
    text = ServerMetrics(llm.engine, "demo").render().decode()
    assert 'nvllm:spec_decode_num_drafts_total{model_name="demo"} 3.0' in text
    assert 'nvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="3"} 3.0' in text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("nvllm:spec"))
    stats = spec_decode_stats({k: float(v) for k, v in samples.items()})
    assert stats["spec_decode_acceptance_rate"] == 100.0 and stats["spec_decode_acceptance_length"] == 5.0
    plain = ServerMetrics(make_llm(demo_dir).engine, "demo").render().decode()
    assert "spec_decode" not in plain


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_self_draft_accepts_everything(chain, top_p, demo_dir, drafts):
    """A self-draft sampling at the target's temperature proposes from q = p, so every draft is accepted
    (min(1, p/q) = 1): any wrong token fed back between draft steps, or a q shaped unlike p, would show as a
    rejection. Step by step and through the chain's sampled graphs (with and without the top-p filter)."""
    llm = make_llm(demo_dir, speculative=spec_of("self", drafts, 4))
    if chain:
        chained(llm, 4)
    params = SamplingParams(temperature=0.8, top_p=top_p, max_tokens=21, ignore_eos=True, seed=3)
    llm.generate(prompts(6), params, use_tqdm=False)
    s = llm.engine.stats.spec
    assert s.num_drafts > 0 and s.acceptance_rate == 1.0
    assert not chain or llm.engine.spec.proposer.chain.runs > 0


@pytest.mark.parametrize("draft", ["truncated", "ngram"])
def test_target_step_takes_the_drafts_on_the_device(draft, drafts, alone, demo_dir, monkeypatch):
    """A draft model's tokens reach the target's verify step as placeholders resolved on the device, and the host
    reads them only after the target's step was launched; n-gram drafts are host ids. Outputs unchanged."""
    llm = make_llm(demo_dir, speculative=spec_of(draft, drafts, 3))
    events: list[str] = []
    execute, read = llm.engine.runner.execute, Drafts.read

    def recording_execute(scheduled, rows, ids=None, prev_tokens=None, **kw):
        if ids:
            events.append("execute")
            on_device = all(t < 0 for v in ids.values() for t in v)
            assert on_device == (draft != "ngram") and isinstance(prev_tokens, torch.Tensor) == on_device
        return execute(scheduled, rows, ids, prev_tokens, **kw)

    def recording_read(self):
        events.append("read")
        read(self)

    monkeypatch.setattr(llm.engine.runner, "execute", recording_execute)
    monkeypatch.setattr(Drafts, "read", recording_read)
    ps = prompts(4)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in ps]
    assert len(events) > 4 and events == ["execute", "read"] * (len(events) // 2)
    assert llm.engine.stats.spec.num_drafts > 0


def test_bench_latency_reports_acceptance(drafts, tmp_path):
    from typer.testing import CliRunner

    from nvllm.cli import app

    out = tmp_path / "lat.json"
    res = CliRunner().invoke(app, ["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "9",
                                   "--num-iters-warmup", "0", "--num-iters", "1", "--save-result", str(out),
                                   "--device", "cpu", "--log-stats-interval", "0", "--no-progress",
                                   "--speculative", spec_of("self", drafts, 3)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["spec_decode_num_drafts"] > 0 and r["spec_decode_acceptance_rate"] > 90.0
    assert r["speculative"].startswith("k=3")


# ---- start-up checks, k=auto, block trimming, CLI -----------------------------------------------------
def test_mismatched_vocabularies_rejected(tmp_path, demo_dir):
    small = build_tiny_model("llama", tmp_path / "small", vocab_size=256)
    with pytest.raises(ConfigError, match="does not cover"):
        make_llm(demo_dir, speculative=f"k=2,draft={small}")
    other = truncated_copy(tmp_path / "other", 1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        make_llm(demo_dir, speculative=f"k=2,draft={other}")


@pytest.mark.parametrize("draft, want_k", [("self", 8), ("random", 1)])
def test_k_auto_follows_acceptance(draft, want_k, drafts, demo_dir):
    llm = make_llm(demo_dir, speculative=spec_of(draft, drafts, "auto"))
    e = llm.engine
    fed = []   # tokens of each forward the draft model ran
    forward = e.spec.proposer._forward
    e.spec.proposer._forward = lambda items, *a, **kw: fed.append(sum(len(ids) for _, _, ids in items)) or \
        forward(items, *a, **kw)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    e.add_request("r", "Once upon a time", params)
    seq = e.requests["r"][0]
    while e.has_unfinished_requests():
        e.step()
    assert seq.spec_state.k == want_k
    assert seq.output_token_ids == make_llm(demo_dir).generate(["Once upon a time"], params,
                                                               use_tqdm=False)[0].outputs[0].token_ids
    unit = AdaptiveK(start=2, window=2)
    st = unit.new_state()
    for drafted, accepted in [(2, 2), (2, 2), (3, 1), (3, 0), (2, 1), (2, 1)]:
        unit.update(st, drafted, accepted)
    assert st.k == 2  # up (100%), down (1/6), then 50% holds
    if draft == "random":   # a draft that never agrees pauses: 16 + 32 + 64 plain steps between probe windows,
        assert e.stats.spec.num_drafts < 60, e.stats.spec.num_drafts   # whose tokens the draft takes in one
        assert len(fed) < 80, len(fed)                                  # catch-up forward (51 here, 144 if mirrored)


def test_k_auto_pauses_a_useless_draft_and_probes_again():
    unit = AdaptiveK(start=1, window=2, min_pause=3, max_pause=6)
    st = unit.new_state()
    ks = []
    for _ in range(20):
        k = unit.k_now(st)
        ks.append(k)
        if k:
            unit.update(st, k, 0)           # nothing accepted
    assert ks == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]   # pauses of 3, 6, then 6 again
    while st.paused:
        unit.k_now(st)
    for _ in range(2):                      # acceptance returns: k grows, and a later failure pauses 3 steps again
        unit.update(st, 1, 1)
    assert (st.pause, st.k, unit.k_now(st)) == (0, 2, 2)


@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_a_long_catch_up_runs_within_the_token_budget(draft, drafts, demo_dir):
    """After drafting was off (disable_by_batch_size), the long request's draft cache lacks its whole prompt and
    output so far: the draft takes them in forwards of at most max_num_batched_tokens, not in one — outputs equal
    plain decoding's."""
    ps = ["He liked to play with his ball. He liked to play with his ball and the dog ran in the park all day.",
          *prompts(3)]
    params = [SamplingParams(temperature=0, max_tokens=60 if i == 0 else 30, ignore_eos=True) for i in range(4)]
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, params, use_tqdm=False)]
    llm = make_llm(demo_dir, max_num_batched_tokens=16, speculative=spec_of(draft, drafts) + ",disable_by_batch_size=2")
    runner = llm.engine.spec.proposer.runner
    sizes, run_model = [], runner.run_model

    def recording(step, *a, **kw):
        sizes.append(len(step.input_ids))
        return run_model(step, *a, **kw)

    runner.run_model = recording
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    assert max(sizes) <= 16, sizes   # the catch-up of 30-odd tokens took two forwards, not one of 32
    assert llm.engine.stats.spec.num_drafts > 0


def test_synthetic_acceptance_benchmark_mode(drafts, demo_dir):
    """The benchmark mode overrides the models: a self-draft (naturally 100%) accepts at the set rate."""
    assert parse_speculative("k=4,method=ngram,synthetic_acceptance=0.5").synthetic_acceptance == 0.5
    for bad in ("k=4,method=ngram,synthetic_acceptance=1.5", "k=4,method=ngram,synthetic_acceptance=x"):
        with pytest.raises(ConfigError, match="synthetic_acceptance"):
            parse_speculative(bad)
    rate = 0.5
    llm = make_llm(demo_dir, speculative=spec_of("self", drafts, 4) + f",synthetic_acceptance={rate}")
    llm.generate(prompts(8), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    s = llm.engine.stats.spec
    # accepted tokens per draft of k=4 under Bernoulli(0.5) runs: E = 0.5 + 0.25 + 0.125 + 0.0625 = 0.9375
    assert s.num_drafts > 60
    assert abs(s.num_accepted_tokens / s.num_drafts - 0.9375) < 0.3
    assert s.accepted_per_pos[0] > s.accepted_per_pos[1] > s.accepted_per_pos[3]


def test_disable_by_batch_size(drafts, demo_dir):
    """No drafting while the batch is at the limit; when it shrinks the draft catches up on what it skipped and
    speculation resumes — greedy outputs unchanged throughout."""
    ps = prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=8 if i else 40, ignore_eos=True) for i in range(len(ps))]
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, params, use_tqdm=False)]
    llm = make_llm(demo_dir, speculative=spec_of("self", drafts) + ",disable_by_batch_size=3")
    drafted_at: list[int] = []
    verify = llm.engine.spec.verify

    def recording(logits, entries):
        drafted_at.append(len(llm.engine.scheduler.running))
        return verify(logits, entries)

    llm.engine.spec.verify = recording
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    assert drafted_at and max(drafted_at) < 3  # drafts only once the five short requests were done
    s = llm.engine.stats.spec
    assert s.num_drafts > 0 and s.acceptance_rate == 1.0  # the skipped tokens were caught up exactly
    assert "off from 3 running" in llm.engine.spec.spec_config.describe()
    with pytest.raises(ConfigError, match="at least 2"):
        parse_speculative("k=2,method=ngram,disable_by_batch_size=1")
