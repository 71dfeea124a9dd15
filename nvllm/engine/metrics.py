"""Engine statistics: counters the step loop updates, and the periodic log line built from them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from nvllm.spec.metrics import SpecStats

logger = logging.getLogger("nvllm")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    # vLLM's prompt token counts: a sequence's whole prompt once its first token is drawn (a preempted one is not
    # counted again), and by where its KV came from: computed here, found in the prefix cache, or received from a
    # prefill worker (disaggregation's decode side)
    prompt_tokens: int = 0
    prompt_tokens_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROMPT_SOURCES, 0))
    generation_tokens: int = 0
    num_steps: int = 0
    spec: SpecStats | None = None  # speculative-decoding counters (None: speculation off)

    def count_prompt(self, total: int, cached: int, received: int = 0) -> None:
        """A sequence's prompt, once (at its first token; on a decode worker once its KV is placed): ``total``
        tokens, ``cached`` found in this engine's prefix cache, ``received`` from a prefill worker, the rest
        computed here (a prompt whose transfer failed is recomputed: all of it)."""
        self.prompt_tokens += total
        by = self.prompt_tokens_by_source
        by["external_kv_transfer"] += received
        by["local_cache_hit"] += cached
        by["local_compute"] += total - cached - received


@dataclass
class StatLogger:
    """Logs one line every `interval` seconds while the engine works. A loop that waits for requests asks
    ``due_in`` how long it may sleep before the line that covers its last tokens is due, and calls ``restart``
    when work arrives after an idle time with nothing left to log: each line covers at most one interval, never
    the idle time before it."""

    interval: float
    _last_time: float = field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_gen: int = 0
    _last_queries: int = 0
    _last_hits: int = 0
    _last_spec: SpecStats | None = None

    def due_in(self, s: EngineStats) -> float | None:
        """Seconds until the line covering tokens not yet logged is due (0: now); None when nothing waits."""
        if self.interval <= 0 or (s.prompt_tokens == self._last_prompt and s.generation_tokens == self._last_gen):
            return None
        return max(0.0, self.interval - (time.monotonic() - self._last_time))

    def restart(self) -> None:
        """The next line's rates count from now (the engine was idle, everything before was logged)."""
        self._last_time = time.monotonic()

    def maybe_log(self, s: EngineStats, force: bool = False) -> None:
        now = time.monotonic()
        dt = now - self._last_time
        if self.interval <= 0 or (not force and dt < self.interval):  # 0: no stats lines at all
            return
        q, h = s.prefix_queries - self._last_queries, s.prefix_hits - self._last_hits
        hit_rate = f"{100 * h / q:.1f}%" if q else "n/a"
        msg = ("running: %d, waiting: %d, kv_cache_usage: %.1f%%, prefix_cache_hit_rate: %s, "
               "prompt: %.1f tok/s, generation: %.1f tok/s, preemptions: %d")
        args = [s.num_running, s.num_waiting, 100 * s.kv_cache_usage, hit_rate,
                (s.prompt_tokens - self._last_prompt) / max(dt, 1e-9),
                (s.generation_tokens - self._last_gen) / max(dt, 1e-9), s.num_preemptions]
        if s.spec is not None:  # speculative decoding: acceptance over the interval
            d = s.spec.since(self._last_spec)
            msg += ", spec_acceptance: %s, avg_spec_tokens: %s, spec_per_position: %s"
            args += [f"{100 * d.acceptance_rate:.1f}%", f"{d.mean_acceptance_length:.2f}",
                     "/".join(f"{r:.2f}" for r in d.per_position_rate()) or "-"] if d.num_drafts else ["n/a"] * 3
            self._last_spec = s.spec.copy()
        logger.info(msg, *args)
        self._last_time, self._last_prompt, self._last_gen = now, s.prompt_tokens, s.generation_tokens
        self._last_queries, self._last_hits = s.prefix_queries, s.prefix_hits
