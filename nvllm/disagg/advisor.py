"""Should this workload be served disaggregated? The decision table, applied to measurements of the workload on
a mixed server (taken by `nvllm bench advise`, nvllm.bench.advise), with the numbers behind the verdict.

  short prompts (median < 500 tokens) at low load (< 8 requests in flight)       → stay mixed
  long prompts (median > 2000 tokens) at high concurrency (>= 16 in flight)      → disaggregate
  otherwise, measured: prefills stretch TPOT by >= 1.25x and prompts take >= 15%
  of the engine's time                                                            → disaggregate, else stay mixed
  disaggregating needs a GPU per worker: on one host with N GPUs, split by GPU — x prefill and N - x decode
  workers, x from the prefill share of the engine's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table

SHORT_PROMPT, LONG_PROMPT = 500, 2000  # tokens (median prompt)
LOW_LOAD, HIGH_LOAD = 8.0, 16.0  # mean requests in flight
TPOT_INFLATION, PREFILL_SHARE = 1.25, 0.15


@dataclass
class Workload:
    """What the advisor needs to know, measured on a mixed server."""

    num_requests: int
    prompt_len_p50: float
    prompt_len_p90: float
    prompt_len_p99: float
    output_len_p50: float
    output_len_p90: float
    request_rate: float  # completed requests per second over the run
    mean_in_flight: float  # Little's law: the sum of the latencies over the duration
    num_gpus: int  # GPUs of the host the deployment would run on
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    decode_step_ms: float | None = None  # the server's mean decode-only step
    mixed_step_ms: float | None = None  # its mean step with prompt tokens and decodes
    tpot_inflation: float | None = None  # mean decode step time / decode-only step time (prefills' stretch)
    prefill_share: float | None = None  # share of the engine's time spent on prompt tokens
    inflation_source: str = "server steps"  # or "client ITL p99/p50" when the server counts no steps


@dataclass
class Recommendation:
    verdict: str  # "disaggregate" | "stay mixed"
    prefill_workers: int
    decode_workers: int
    command: str
    reasons: list[str] = field(default_factory=list)


def split(num_gpus: int, prefill_share: float | None) -> tuple[int, int]:
    """Prefill and decode workers for num_gpus GPUs (at least 2), in proportion to the prefill share of the work."""
    n = max(num_gpus, 2)
    x = round(n * prefill_share) if prefill_share is not None else n // 2
    x = min(max(x, 1), n - 1)
    return x, n - x


def recommend(w: Workload) -> Recommendation:
    reasons: list[str] = []
    inflation, share = w.tpot_inflation, w.prefill_share
    measured = (f"prefills stretch TPOT by {inflation:.2f}x ({w.inflation_source})" if inflation is not None
                else "the prefills' effect on TPOT was not measured")
    if share is not None:
        measured += f" and take {share:.0%} of the engine's time"
    by_table = True  # decided by the prompt-length and load rows of the table (else by the measurement)
    if w.prompt_len_p50 < SHORT_PROMPT and w.mean_in_flight < LOW_LOAD:
        verdict = "stay mixed"
        reasons.append(f"short prompts (median {w.prompt_len_p50:.0f} < {SHORT_PROMPT} tokens) at low load "
                       f"({w.mean_in_flight:.1f} < {LOW_LOAD:.0f} requests in flight): prefills are short and rare; "
                       "a split would idle GPUs and add a KV transfer to every request")
    elif w.prompt_len_p50 > LONG_PROMPT and w.mean_in_flight >= HIGH_LOAD:
        verdict = "disaggregate"
        reasons.append(f"long prompts (median {w.prompt_len_p50:.0f} > {LONG_PROMPT} tokens) at high concurrency "
                       f"({w.mean_in_flight:.1f} >= {HIGH_LOAD:.0f} requests in flight): each prefill stalls every "
                       "decode batched with it")
    elif (inflation is not None and inflation >= TPOT_INFLATION and share is not None
          and share >= PREFILL_SHARE):
        verdict, by_table = "disaggregate", False
        reasons.append(f"{measured} (thresholds {TPOT_INFLATION}x and {PREFILL_SHARE:.0%})")
    else:
        verdict, by_table = "stay mixed", False
        reasons.append(f"{measured}: below the thresholds ({TPOT_INFLATION}x and {PREFILL_SHARE:.0%}) that pay "
                       "for a split")
    if by_table:
        reasons.append(measured[0].upper() + measured[1:])
    x, y = split(w.num_gpus, share)
    if verdict == "disaggregate" and w.num_gpus < 2:
        verdict = "stay mixed"
        reasons.append("disaggregation needs a GPU per worker and this host has one: on a host with several "
                       f"GPUs, split them {x}:{y}")
        command = "nvllm serve …"
    elif verdict == "disaggregate":
        basis = f"prefill takes {share:.0%} of the work" if share is not None else "prefill share unmeasured"
        reasons.append(f"{w.num_gpus} GPUs on one host: split by GPU, {x} prefill + {y} decode workers ({basis})")
        command = f"nvllm serve --disaggregate {x}P{y}D …"
    elif w.num_gpus >= 2:
        command = f"{w.num_gpus} × nvllm serve (one per GPU) behind nvllm router --mixed URL,…"
    else:
        command = "nvllm serve …"
    return Recommendation(verdict, x, y, command, reasons)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


def tables(w: Workload, r: Recommendation) -> list[Table]:
    t = Table(title="workload measured on the mixed server", show_header=False, title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [("Requests measured", str(w.num_requests)),
            ("Prompt tokens p50 / p90 / p99",
             f"{w.prompt_len_p50:.0f} / {w.prompt_len_p90:.0f} / {w.prompt_len_p99:.0f}"),
            ("Output tokens p50 / p90", f"{w.output_len_p50:.0f} / {w.output_len_p90:.0f}"),
            ("Request rate (req/s)", f"{w.request_rate:.2f}"), ("Mean requests in flight", f"{w.mean_in_flight:.1f}"),
            ("TTFT p99 (ms)", _ms(w.ttft_p99_ms)), ("TPOT p99 (ms)", _ms(w.tpot_p99_ms)),
            ("ITL p50 / p99 (ms)", f"{_ms(w.itl_p50_ms)} / {_ms(w.itl_p99_ms)}"),
            ("Decode-only step (ms)", _ms(w.decode_step_ms)),
            ("Step with prefill + decodes (ms)", _ms(w.mixed_step_ms)),
            (f"TPOT inflation by prefills ({w.inflation_source})",
             "n/a" if w.tpot_inflation is None else f"{w.tpot_inflation:.2f}x"),
            ("Prefill share of engine time", "n/a" if w.prefill_share is None else f"{w.prefill_share:.0%}"),
            ("GPUs on the serving host", str(w.num_gpus))]
    for label, value in rows:
        t.add_row(label, value)
    rec = Table(title="recommendation", show_header=False, title_justify="left")
    rec.add_column("", style="bold")
    rec.add_column("")
    rec.add_row("Verdict", f"[bold]{r.verdict}[/]")
    rec.add_row("Prefill : decode workers", f"{r.prefill_workers}:{r.decode_workers}")
    rec.add_row("Command", r.command)
    for i, reason in enumerate(r.reasons):
        rec.add_row("Why" if i == 0 else "", reason)
    return [t, rec]
