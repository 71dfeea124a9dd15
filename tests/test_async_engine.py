"""The async engine the server runs, in process: streams of outputs, bad input as ValueError, a consumer that
stops early aborting its request, and an add cancelled before it lands."""

from __future__ import annotations

import asyncio
import time

import pytest

MAX_MODEL_LEN = 256
PROMPT = "Once upon a time"


def test_async_engine_in_process():
    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.sampling_params import SamplingParams

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, max_model_len=MAX_MODEL_LEN), warmup=False)
    engine = AsyncLLMEngine(core)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        outs = [o async for o in engine.generate(PROMPT, greedy)]
        assert len(outs) == 8 and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([5] * MAX_MODEL_LEN, greedy):
                pass
        # a consumer that stops early (and closes the generator) aborts its request at once
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        deadline = time.monotonic() + 10
        while core.block_manager.num_free_blocks != core.block_manager.num_blocks:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # shutdown ends what is in flight with finish_reason "abort"
        stream = engine.open_stream()
        await stream.add(None, PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await engine.shutdown()
        last = [o async for o in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert not engine.is_running and not core.has_unfinished_requests()

    asyncio.run(main())


def test_a_reader_that_falls_behind_holds_a_bounded_number_of_outputs():
    """A stream not read while its request generates 100 tokens (a client whose socket is full) keeps its first
    MAX_UNREAD - 1 outputs and the latest, not one a step (cumulative snapshots: memory quadratic in the length);
    the reader still gets every token, and a reader that keeps up one output a step."""
    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.output_stream import OutputStream
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.sampling_params import SamplingParams

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, max_model_len=MAX_MODEL_LEN), warmup=False)
    engine = AsyncLLMEngine(core)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main():
        stream = engine.open_stream()
        await stream.add(None, PROMPT, params)
        deadline = time.monotonic() + 60
        while not (stream._queue and stream._queue[-1][0].finished):  # nothing read until the request finished
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        stalled = [o async for o in stream]
        kept = OutputStream.MAX_UNREAD
        assert [len(o.outputs[0].token_ids) for o in stalled] == [*range(1, kept), 100]
        assert stalled[-1].finished and all(
            stalled[-1].outputs[0].token_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in stalled)
        live = [o async for o in engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0,
                                                                        ignore_eos=True))]
        assert len(live) == 30 and live[-1].outputs[0].token_ids == stalled[-1].outputs[0].token_ids[:30]
        await engine.shutdown()

    asyncio.run(main())


def test_a_reader_behind_a_failed_engine_gets_the_error():
    """The engine fails while a reader is more than MAX_UNREAD outputs behind: the stream still ends in the error
    after the outputs before it (the abort that follows the error must not overtake it as a normal finish)."""
    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.output_stream import EngineDeadError, OutputStream
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.sampling_params import SamplingParams

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, max_model_len=MAX_MODEL_LEN), warmup=False)
    engine = AsyncLLMEngine(core)
    steps, real_step = [0], core.step

    def failing_step():
        steps[0] += 1
        if steps[0] > 2 * OutputStream.MAX_UNREAD:
            raise RuntimeError("a device fault")
        return real_step()

    core.step = failing_step

    async def main():
        stream = engine.open_stream()
        await stream.add(None, PROMPT, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not (stream._queue and isinstance(stream._queue[-1], BaseException)):  # nothing read meanwhile
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        got = []
        with pytest.raises(EngineDeadError, match="a device fault"):
            async for out in stream:
                got.append(out)
        assert len(got) == OutputStream.MAX_UNREAD and not got[-1].finished
        await engine.shutdown()

    asyncio.run(main())


def test_async_engine_survives_an_add_cancelled_before_it_lands():
    """A caller that gives up while its add waits behind a running step (a client gone, a timeout) must not
    take the engine loop down: the add is dropped and everyone else carries on."""
    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.sampling_params import SamplingParams

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, max_model_len=MAX_MODEL_LEN), warmup=False)
    engine = AsyncLLMEngine(core)

    async def main():
        long = engine.open_stream()
        await long.add(None, PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
        await long.__anext__()
        for _ in range(5):
            task = asyncio.ensure_future(engine.open_stream().add(None, "The dog", SamplingParams(max_tokens=4)))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        last = [o async for o in long][-1]
        assert engine.is_running and engine.error is None
        assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 100
        await engine.shutdown()

    asyncio.run(main())


def test_a_prefilled_add_cancelled_while_it_lands_still_hands_over_its_kv_targets():
    """Decode side of disaggregation: a client gone while the engine registers its prefilled request (the add has
    begun, so it cannot be withdrawn) must not strand the blocks given to the arriving KV. The request is aborted
    behind the add, and its targets still reach the transfer thread (``receive``), which frees them on finding the
    sequences aborted — before, the targets were lost with the cancelled await and the blocks stayed taken."""
    import threading

    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.engine.sequence import PrefilledSample
    from nvllm.sampling_params import SamplingParams

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, max_model_len=MAX_MODEL_LEN), warmup=False)
    engine = AsyncLLMEngine(core)
    bm = core.block_manager
    started, go, handed = threading.Event(), threading.Event(), []
    register = core.add_prefilled_request

    def slow_register(*args, **kw):  # the engine thread is inside the add when the client goes
        started.set()
        go.wait(10)
        return register(*args, **kw)

    core.add_prefilled_request = slow_register
    prompt = core.tokenize(PROMPT + " there was a little girl who liked to play in the park with her dog")
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0)

    async def main():
        stream = engine.open_stream()
        task = asyncio.ensure_future(stream.add_prefilled(
            "r", prompt, params, time.time(), [PrefilledSample(7) for _ in range(4)], receive=handed.append))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wrap_future(engine.call(lambda e: None))  # after the add and the aborts queued behind it
        assert [t.seq.index for t in handed] == [0, 1, 2, 3]
        assert all(t.seq.finish_reason == "abort" for t in handed)
        assert bm.num_free_blocks < bm.num_blocks  # the transfer may still be writing into them
        for t in handed:  # what the transfer thread does on finding them aborted
            await asyncio.wrap_future(engine.call(lambda e, seq=t.seq: e.handoff.arrived(seq, False)))
        assert bm.num_free_blocks == bm.num_blocks and not core.has_unfinished_requests()
        # a receiver that fails after taking some targets: the add fails whole, the rest are freed at once
        taken = []

        def flaky(t):
            if t.seq.index == 1:
                raise RuntimeError("the transfer thread is gone")
            taken.append(t)

        with pytest.raises(RuntimeError, match="thread is gone"):
            await engine.open_stream().add_prefilled("s", prompt, params, time.time(),
                                                     [PrefilledSample(7) for _ in range(4)], receive=flaky)
        assert [t.seq.index for t in taken] == [0] and "s" not in core.requests
        assert bm.num_blocks - bm.num_free_blocks == len(taken[0].block_ids)  # the one the transfer owns
        await asyncio.wrap_future(engine.call(lambda e: e.handoff.arrived(taken[0].seq, False)))
        assert bm.num_free_blocks == bm.num_blocks and engine.is_running
        await engine.shutdown()

    asyncio.run(main())
