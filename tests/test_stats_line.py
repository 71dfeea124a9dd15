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
