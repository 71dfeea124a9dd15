"""Continuous batching, chunked prefill, preemption and prefix caching, end to end on the demo model."""

from __future__ import annotations

import pytest

from nvllm import SamplingParams
from tests.conftest import make_llm

WORDS = ("Once upon a time there was a little girl named Lily who loved to play in the park with her "
         "big red ball and her friend Tom the dog").split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[i % 7: i % 7 + 3 + (5 * i) % 19]) for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def alone(demo_dir):
    llm = make_llm(demo_dir, enable_prefix_caching=False)
    return {p: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts(18)}


def test_batch_with_chunked_prefill_and_preemption_equals_alone(demo_dir, alone):
    # 8 blocks of 8 tokens hold 64 tokens: a few sequences at a time, so running ones get preempted
    llm = make_llm(demo_dir, block_size=8, num_kv_blocks=8, max_num_batched_tokens=12, max_num_seqs=6,
                   max_model_len=64)
    outs = llm.generate(prompts(18), GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts(18), outs):
        assert o.outputs[0].token_ids == alone[p], p
        assert o.num_cached_tokens < len(o.prompt_token_ids)  # re-admissions after preemption don't count
    # vLLM's prompt_tokens: each prompt once, however often a preempted sequence was recomputed
    stats = llm.engine.stats
    assert stats.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert sum(stats.prompt_tokens_by_source.values()) == stats.prompt_tokens
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_aborting_many_waiting_requests_leaves_the_rest_as_they_were(demo_dir, alone):
    """Requests aborted while they wait (a client gone with a large batch) leave the queue without a scan of it
    apiece: finished ones are dropped as the queue is read or swept, never more than half of it, and the counts
    and outputs of the rest are as without them."""
    llm = make_llm(demo_dir, max_num_seqs=2)
    engine, sched = llm.engine, llm.engine.scheduler
    keep = prompts(3)
    kept = [engine.add_request(f"keep{i}", p, GREEDY) for i, p in enumerate(keep)]
    gone = [engine.add_request(f"gone{i}", "Once upon a time", SamplingParams(n=4, max_tokens=5)) for i in range(200)]
    assert sched.num_waiting == 3 + 800
    for rid in reversed(gone):
        assert engine.abort_request(rid).finished
        assert len(sched.waiting) - sched.num_waiting <= max(16, sched.num_waiting)  # swept: at most half finished
    assert sched.num_waiting == 3 and [s.request_id for s in sched.waiting_seqs()] == kept
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[rid].outputs[0].token_ids for rid in kept] == [alone[p] for p in keep]
    assert sched.num_waiting == 0 and not sched.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_preempted_sequence_finding_its_own_blocks_is_no_prefix_cache_hit(demo_dir):
    """The hit rate (/metrics' prefix_cache_queries/hits, the log's) counts each prompt's lookup once: prompts that
    share nothing hit nothing, however often preempted sequences come back to their own blocks (vLLM keeps those
    lookups apart, as preempted_queries/hits)."""
    ps = [[1 + i] + [(37 * i + 11 * j) % 400 + 3 for j in range(20)] for i in range(8)]  # distinct first tokens
    llm = make_llm(demo_dir, num_kv_blocks=16, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    bm = llm.engine.block_manager
    assert llm.engine.scheduler.num_preemptions > 0 and bm.preempted_hits > 0
    assert [o.num_cached_tokens for o in outs] == [0] * 8
    assert (bm.prefix_queries, bm.prefix_hits) == (sum(map(len, ps)), 0)


def test_reset_prefix_cache_as_vllms_llm(demo_dir):
    """LLM.reset_prefix_cache(): the next run of a prompt finds nothing cached (benchmarks reset between runs)."""
    llm = make_llm(demo_dir, block_size=8)
    p = " ".join(WORDS)
    llm.generate([p], GREEDY, use_tqdm=False)
    assert llm.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_chunked_prefill_splits_long_prompts(demo_dir, alone):
    llm = make_llm(demo_dir, max_num_batched_tokens=4)
    p = max(prompts(18), key=len)
    n_prompt = len(llm.get_tokenizer().encode(p))
    out = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone[p]
    # ceil(n/4) prefill chunks (the last also samples the first token), then one step per further token
    assert llm.engine.stats.num_steps == -(-n_prompt // 4) + GREEDY.max_tokens - 1


def test_prefix_cache_hit_same_output_and_pool_refills(demo_dir):
    shared = " ".join(WORDS * 2)
    a, b = shared + " and then", shared + " but one day"
    plain = make_llm(demo_dir, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate([a, b], GREEDY, use_tqdm=False)]

    llm = make_llm(demo_dir, block_size=16)
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    second = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    common = len(llm.get_tokenizer().encode(shared)) - 1
    assert second.num_cached_tokens >= (common // 16) * 16 > 0
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == want
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_hits == second.num_cached_tokens
    # prefix-cache hits count among the prompt tokens, by their source
    total = len(first.prompt_token_ids) + len(second.prompt_token_ids)
    assert llm.engine.stats.prompt_tokens == total
    assert llm.engine.stats.prompt_tokens_by_source == {
        "local_compute": total - second.num_cached_tokens, "local_cache_hit": second.num_cached_tokens,
        "external_kv_transfer": 0}
    # a request for prompt logprobs computes its whole prompt: it is not a lookup, so not a miss either (vLLM)
    queries = bm.prefix_queries
    logprobs = llm.generate([b], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), use_tqdm=False)[0]
    assert logprobs.num_cached_tokens == 0 and bm.prefix_queries == queries


def test_same_prompt_twice_in_one_batch(demo_dir, alone):
    p = prompts(18)[5]
    llm = make_llm(demo_dir)
    outs = llm.generate([p, p, p], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone[p] for o in outs)


def test_pool_smaller_than_max_model_len(demo_dir):
    """A sequence may grow to max_model_len, so the pool must hold that many tokens: the model's limit is
    lowered to the pool (and an explicit larger one refused) instead of a lone sequence preempting itself
    forever and blocking everyone behind it."""
    from nvllm.config import ConfigError

    with pytest.raises(ConfigError, match="exceeds the KV cache's 32 tokens"):
        make_llm(demo_dir, block_size=8, num_kv_blocks=4, max_model_len=256)
    for caching in (True, False):
        llm = make_llm(demo_dir, block_size=8, num_kv_blocks=4, max_num_batched_tokens=16,
                       enable_prefix_caching=caching)
        assert llm.engine.max_model_len == 32
        big, small = llm.generate(["Once upon a time", "The dog"],
                                  [SamplingParams(max_tokens=100, ignore_eos=True), SamplingParams(max_tokens=5)],
                                  use_tqdm=False)
        assert big.finished and big.outputs[0].finish_reason == "length"
        assert len(big.prompt_token_ids) + len(big.outputs[0].token_ids) == 32
        assert small.finished and len(small.outputs[0].token_ids) == 5


def test_out_of_vocabulary_stop_token_refused_before_anything_runs(demo_dir):
    llm = make_llm(demo_dir)
    with pytest.raises(ValueError, match="stop token id 1000000 is outside the vocabulary"):
        llm.generate(["The dog", "The cat"], [SamplingParams(), SamplingParams(min_tokens=2, stop_token_ids=[10**6])],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_priority_policy_admits_and_keeps_lower_values_first(demo_dir, alone, monkeypatch):
    """vLLM's priority scheduling: with one sequence at a time the requests run in priority order (lower first,
    arrival among equals); under memory pressure preemption takes the highest value; outputs are as alone."""
    ps = prompts(6)
    llm = make_llm(demo_dir, scheduling_policy="priority", max_num_seqs=1, enable_prefix_caching=False)
    outs = llm.generate(ps, GREEDY, use_tqdm=False, priority=[3, 1, 2, 0, 1, 5])
    first = [o.metrics.first_token_time for o in outs]
    assert sorted(range(6), key=first.__getitem__) == [3, 1, 4, 2, 0, 5]
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in ps]

    fcfs = make_llm(demo_dir, max_num_seqs=1, enable_prefix_caching=False)
    outs = fcfs.generate(ps, GREEDY, use_tqdm=False)
    first = [o.metrics.first_token_time for o in outs]
    assert sorted(range(6), key=first.__getitem__) == list(range(6))

    # 8 blocks of 8 tokens: running sequences get preempted, always the one of the highest value (then latest)
    tight = make_llm(demo_dir, scheduling_policy="priority", block_size=8, num_kv_blocks=8,
                     max_num_batched_tokens=12, max_num_seqs=6, max_model_len=64)
    sched, victims = tight.engine.scheduler, []
    preempt = sched._preempt

    def record(seq):
        victims.append((seq.priority, max(s.priority for s in sched.running + [seq])))
        preempt(seq)

    monkeypatch.setattr(sched, "_preempt", record)
    priorities = [i % 3 for i in range(18)]
    outs = tight.generate(prompts(18), GREEDY, use_tqdm=False, priority=priorities)
    assert victims and all(p == highest for p, highest in victims)
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in prompts(18)]


def test_priority_needs_the_priority_policy(demo_dir):
    llm = make_llm(demo_dir)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts(2), GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.engine.add_request(None, "hello", GREEDY, priority=2)
    assert llm.generate(prompts(2), GREEDY, use_tqdm=False, priority=[0, 0])   # all 0: first come, first served
    with pytest.raises(ValueError, match="one integer per prompt"):
        make_llm(demo_dir, scheduling_policy="priority").generate(prompts(2), GREEDY, use_tqdm=False, priority=[1])
    from nvllm.config import ConfigError

    with pytest.raises(ConfigError, match="scheduling_policy 'lifo'"):
        make_llm(demo_dir, scheduling_policy="lifo")


def test_a_high_priority_prompt_does_not_stall_running_decodes(demo_dir):
    """As vLLM's: only the waiting queue is in priority order; running sequences keep their admission order, so a
    long prompt of a higher priority admitted later shares the step's budget with the decodes already running."""
    llm = make_llm(demo_dir, scheduling_policy="priority", max_num_batched_tokens=16, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request(None, prompts(3)[0], params, priority=5)
    while eng.scheduler.running[0].num_computed_tokens < eng.scheduler.running[0].num_prompt_tokens \
            if eng.scheduler.running else True:
        eng.step()
    eng.add_request(None, " ".join(WORDS * 3), params, priority=0)
    eng.step()   # admitted, its first chunk beside the decode
    out = eng.scheduler.schedule()   # still prefilling: the decode keeps its place
    assert [(s.priority, n) for s, n in out.scheduled] == [(5, 1), (0, 15)]


def test_waiting_seqs_reads_a_queue_the_engine_thread_changes_meanwhile(demo_dir):
    """/metrics lists the waiting sequences' adapters from the event loop while the engine thread queues and drops
    sequences: a change between two items of the read (here made by reading a sequence's status) must not end the
    read in "deque mutated during iteration" (a 500 for the scrape)."""
    llm = make_llm(demo_dir, max_num_seqs=1)
    engine, sched = llm.engine, llm.engine.scheduler
    for i in range(3):
        engine.add_request(f"r{i}", "Once upon a time", GREEDY)
    first = sched.waiting[0]

    class Switching:  # a sequence whose status is read while "the engine thread" queues another
        request_id = "switch"

        @property
        def status(self):
            sched.waiting.append(first)
            return first.status

    sched.waiting.appendleft(Switching())
    assert [s.request_id for s in sched.waiting_seqs()] == ["switch", "r0", "r1", "r2"]
