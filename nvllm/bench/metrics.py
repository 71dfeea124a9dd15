"""Serving-benchmark metrics, defined as vLLM's serving benchmark defines them, so results compare directly.

Per request (client-side clock, seconds):
  TTFT = send → first content chunk;  ITL = the gaps between consecutive content chunks;
  E2EL = send → last content chunk;   TPOT = (E2EL − TTFT) / (output_len − 1), only when output_len > 1
  (output_len from the server's usage; for goodput a request with output_len ≤ 1 counts TPOT as 0).
Over the run: request / output / total token throughput = completed requests, output tokens, input+output
tokens divided by the run's duration; goodput = completed requests meeting every SLO, per second.
Statistics: mean, median, std (population, as numpy's default) and linear-interpolated percentiles.

One deliberate difference: where there is nothing to measure (no request succeeded, no request produced
two tokens, no ITL gap) the statistic is None, not 0 — a number is only reported when it was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


@dataclass
class RequestResult:
    """One request's client-side timeline (seconds, time.perf_counter clock)."""

    prompt_len: int
    success: bool = False
    output_tokens: int | None = None  # from the server's usage (or counted by the tokenizer when it sends none)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None  # E2EL
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def percentile_key(p: float) -> str:
    """99 → 'p99', 99.9 → 'p99.9' (vLLM's spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' → [50.0, 90.0, 99.0]; raises ValueError with a clear message."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}")
    return values


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """['ttft:200', 'tpot:20'] (milliseconds) → {'ttft': 200.0, 'tpot': 20.0}. Commas also separate pairs."""
    slos: dict[str, float] = {}
    for item in (p for pair in pairs for p in pair.replace(",", " ").split()):
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise ValueError(f"goodput SLO {item!r} is not KEY:MILLISECONDS (e.g. ttft:200 tpot:20)")
        if name not in SLO_NAMES:
            raise ValueError(f"goodput SLO {name!r} is unknown; choose from {', '.join(SLO_NAMES)}")
        if not (math.isfinite(ms) and ms > 0):  # nan, inf or 1e999: no SLO, and no number JSON can hold
            raise ValueError(f"goodput SLO {item!r} must be a positive finite number of milliseconds")
        slos[name] = ms
    return slos


def summarize(values: list[float], percentiles: list[float], name: str) -> dict[str, float | None]:
    """mean/median/std/pNN of `values` (seconds) in milliseconds, under vLLM's key names."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    has = arr.size > 0
    out[f"mean_{name}_ms"] = float(arr.mean()) if has else None
    out[f"median_{name}_ms"] = float(np.median(arr)) if has else None
    out[f"std_{name}_ms"] = float(arr.std()) if has else None
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p)) if has else None
    return out


def _peaks(ok: list[RequestResult]) -> tuple[float | None, int | None]:
    """vLLM's two peak figures, over one-second buckets from the first request's start: the most output tokens
    in a bucket, and the most requests active in a bucket (a request counts in every bucket from its start's to
    its end's, so the figure can exceed the requests in flight at any one instant)."""
    if not ok:
        return None, None
    t0 = min(r.start_time for r in ok)
    tokens: dict[int, int] = {}
    active: dict[int, int] = {}
    for r in ok:
        t = r.start_time + r.ttft
        for gap in [0.0] + r.itl:
            t += gap
            tokens[int(t - t0)] = tokens.get(int(t - t0), 0) + 1
        for second in range(int(r.start_time - t0), int(r.start_time + r.latency - t0) + 1):
            active[second] = active.get(second, 0) + 1
    return float(max(tokens.values())), max(active.values())


def request_tpot(latency: float, ttft: float, output_tokens: int) -> float:
    """One request's time per output token after the first (0 when it has fewer than two)."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The serving result dict, keyed as vLLM keys it (per-request lists keep the order of `results`)."""
    if duration <= 0:
        raise ValueError("the run's duration must be positive")
    goodput = goodput or {}
    ok = [r for r in results if r.success]
    output_lens = [(r.output_tokens or 0) if r.success else 0 for r in results]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        n = r.output_tokens or 0
        tpot = request_tpot(r.latency, r.ttft, n)
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)  # goodput counts TPOT as 0 for single-token outputs
    good = 0
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            good += all(per_request[k][i] <= ms / 1000.0 for k, ms in goodput.items())
    peak_tok, peak_conc = _peaks(ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tok,
        "max_concurrent_requests": peak_conc,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft if r.success else None for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "latencies": [r.latency if r.success else None for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(summarize(values, percentiles, name))
    return result
