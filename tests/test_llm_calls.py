"""The offline LLM API's calls as units of work: threads sharing one LLM take turns (each gets what it would get
alone), and a call that ends in an exception or Ctrl-C aborts what it queued, leaving the engine as it found it."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from nvllm import SamplingParams
from tests.conftest import make_llm

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_dir):
    return make_llm(demo_dir)


def _texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_threads_sharing_an_llm_take_turns(llm):
    alone = _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    results, errors = {}, []

    def call(i: int) -> None:
        try:
            results[i] = _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and results == {0: alone, 1: alone, 2: alone}
    assert not llm.engine.has_unfinished_requests() and llm.engine.requests == {}


def test_an_interrupted_call_aborts_what_it_queued(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted(*args, **kwargs):  # Ctrl-C during the third step
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS * 4, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.requests == {}
    free = llm.engine.scheduler.bm.num_free_blocks
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # runs only its own request
    assert _texts(out) == _texts(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    assert llm.engine.scheduler.bm.num_free_blocks == free


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """vLLM's SamplingParams(detokenize=False): token ids only; stop strings, which need the text, are refused."""
    with_text = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids_only = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                    detokenize=False), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in with_text]
    assert [o.outputs[0].text for o in ids_only] == [""] * len(PROMPTS) and all(_texts(with_text))
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)


def test_dropping_the_last_reference_frees_the_engine_at_once(demo_dir):
    """No reference cycle holds the engine: `del llm` frees it, its weights and its cache then and there (a cycle
    kept them until the garbage collector ran, so the next LLM in the process found the memory still taken)."""
    llm = make_llm(demo_dir, enable_lora=True)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    kept = [weakref.ref(o) for o in (llm.engine, llm.engine.runner, llm.engine.runner.model)]
    gc.disable()
    try:
        del llm
        assert [ref() is None for ref in kept] == [True, True, True]
    finally:
        gc.enable()


def test_the_log_level_a_program_sets_stays_and_the_environment_sets_the_first(demo_dir):
    """An LLM built after the program lowered nvllm's log level keeps it (each LLM reset it to INFO);
    NVLLM_LOGGING_LEVEL (vLLM's VLLM_LOGGING_LEVEL) sets the level a process starts with."""
    import logging
    import os
    import subprocess
    import sys

    logger = logging.getLogger("nvllm")
    make_llm(demo_dir)
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        make_llm(demo_dir)
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)
    run = [sys.executable, "-m", "nvllm.cli", "generate", "--device", "cpu", "--max-tokens", "2", "Once"]
    for level, shown in (("WARNING", False), ("info", True)):
        out = subprocess.run(run, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "NVLLM_LOGGING_LEVEL": level, "COLUMNS": "200"})
        assert out.returncode == 0 and ("engine ready" in out.stderr) == shown, out.stderr[-2000:]


def test_close_frees_the_cache_and_refuses_later_calls(demo_dir):
    """close() gives back the KV cache (of the draft model too), so that the next LLM built in the process has the
    memory; the closed LLM then refuses to generate with one clear error, and a second close() is harmless."""
    llm = make_llm(demo_dir, speculative=f"k=2,draft={demo_dir}")
    first = _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    runners = (llm.engine.runner, llm.engine.spec.draft_runner)
    held = [weakref.ref(t) for r in runners for kv in r.kv_caches for t in kv if t is not None]
    assert held and all(ref() is not None for ref in held)
    llm.close()
    gc.collect()
    assert all(ref() is None for ref in held)   # nothing in the engine keeps a cache tensor
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.close()
    again = make_llm(demo_dir)
    assert _texts(again.generate(PROMPTS, GREEDY, use_tqdm=False)) == first
