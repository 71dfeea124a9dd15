"""The engine's periodic stats line (`--log-stats-interval`): its rates count the work since the last line, and the
first line after warm-up counts from the engine's fresh start, not from the warm-up's requests."""

from __future__ import annotations

import logging
import re

from nvllm import SamplingParams
from tests.conftest import make_llm


def test_first_line_after_warmup_counts_from_zero(demo_dir, caplog):
    llm = make_llm(demo_dir, log_stats_interval=1e-6)   # a line every step, the warm-up's steps too
    log = logging.getLogger("nvllm")  # it does not propagate: listen on it directly
    log.addHandler(caplog.handler)
    try:
        llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        log.removeHandler(caplog.handler)
    rates = [(float(p), float(g)) for r in caplog.records
             for p, g in re.findall(r"prompt: (-?[\d.]+) tok/s, generation: (-?[\d.]+) tok/s", r.getMessage())]
    assert len(rates) >= 2
    assert all(p >= 0 and g >= 0 for p, g in rates), rates
    assert any(p > 0 for p, _ in rates) and any(g > 0 for _, g in rates)


def test_a_server_logs_its_last_tokens_on_time_and_never_averages_over_idle_time(caplog):
    """The server's engine loop: the line covering a finished burst comes when it falls due, not with the next
    request; after an idle time the next line's rates count from the new work (a 0.2 s request after 3 s idle said
    '2 tok/s' over the whole gap)."""
    import asyncio
    import time

    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine

    interval = 1.0
    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=interval, max_model_len=256), warmup=False)
    engine = AsyncLLMEngine(core)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    log = logging.getLogger("nvllm")
    log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="nvllm")

    def gen_rates() -> list[float]:
        return [float(g) for r in caplog.records for g in re.findall(r"generation: ([\d.]+) tok/s", r.getMessage())]

    async def main():
        async def burst():
            caplog.clear()
            start = time.monotonic()
            assert len([o async for o in engine.generate("Once upon a time", params)]) == 12
            while not gen_rates() and time.monotonic() - start < 10 * interval:
                await asyncio.sleep(0.05)
            return time.monotonic() - start, gen_rates()

        waited, rates = await burst()
        assert sum(rates) > 0 and waited < 4 * interval, (waited, rates)   # logged without a next request
        await asyncio.sleep(3 * interval)
        _, rates = await burst()
        # 12 tokens in a window of about one interval: far above 12 over the idle time as well
        assert max(rates) > 12 / (2 * interval), rates
        await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(caplog.handler)


def test_an_interval_past_the_platforms_timeout_never_stops_the_engine():
    """--log-stats-interval 1e10 (a way to say "never"): the idle wait is capped at what the platform takes; the
    loop thread stayed alive to serve the next request."""
    import asyncio

    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine

    core = LLMEngine(EngineConfig(device="cpu", log_stats_interval=1e10, max_model_len=256), warmup=False)
    engine = AsyncLLMEngine(core)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        for _ in range(2):
            outs = [o async for o in engine.generate("Once upon a time", params)]
            assert outs[-1].finished
            await asyncio.sleep(0.2)   # the loop goes idle with tokens not yet logged
        assert engine.is_running
        await engine.shutdown()

    asyncio.run(main())
