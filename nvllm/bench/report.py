"""Benchmark output: the Rich results table, `--save-result out.json`, and `bench compare a.json b.json`.

A statistic that was not measured (None in the result) prints as "n/a", never as a number.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from rich.table import Table

from nvllm import output_file
from nvllm.bench.metrics import METRICS
from nvllm.config import missing


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _table(title: str) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    return t


def _stat_rows(t: Table, result: dict[str, Any], name: str, label: str, header: str) -> None:
    keys = [k for k in (f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms") if k in result]
    keys += [k for k in result if k.startswith("p") and k[1:2].isdigit() and k.endswith(f"_{name}_ms")]
    if not keys:
        return
    t.add_section()
    t.add_row(f"[bold]{header}[/]", "")
    for k in keys:
        stat = k.split("_")[0]
        t.add_row(f"{stat.upper() if stat[1:2].isdigit() else stat.capitalize()} {label} (ms)", _fmt(result[k]))


_DISAGG_ROWS = (("Mean prefill stage (ms)", "disagg_mean_prefill_ms"),
                ("Mean handoff to decode (ms)", "disagg_mean_handoff_ms"),
                ("Mean KV transfer (ms)", "disagg_mean_kv_transfer_ms"),
                ("Mean first decode after KV (ms)", "disagg_mean_first_decode_ms"),
                ("KV transferred (MB)", "disagg_kv_mb"),
                ("KV transfer bandwidth (GB/s)", "disagg_kv_transfer_gb_per_s"),
                ("Mean queued on prefill side", "disagg_mean_prefill_waiting"),
                ("Mean queued on decode side", "disagg_mean_decode_waiting"),
                ("Prompts recomputed on decode side", "disagg_kv_recomputed"),
                ("Worker failures", "disagg_worker_failures"))


def results_table(result: dict[str, Any]) -> Table:
    mode = result.get("mode")
    r = result
    if mode == "serve":
        t = _table("serving benchmark result")
        rows = [("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
                ("Maximum request concurrency", r.get("max_concurrency") or "unlimited"),
                ("Request rate configured (req/s)", r.get("request_rate")),
                ("Benchmark duration (s)", r["duration"]), ("Total input tokens", r["total_input_tokens"]),
                ("Total generated tokens", r["total_output_tokens"]),
                ("Request throughput (req/s)", r["request_throughput"])]
        if r.get("request_goodput") is not None:
            rows.append(("Request goodput (req/s)", r["request_goodput"]))
        rows += [("Output token throughput (tok/s)", r["output_throughput"]),
                 ("Peak output token throughput (tok/s)", r.get("max_output_tokens_per_s")),
                 ("Peak concurrent requests", r.get("max_concurrent_requests")),
                 ("Total token throughput (tok/s)", r["total_token_throughput"])]
        for label, v in rows:
            t.add_row(label, _fmt(v))
        for name, label, header in METRICS:
            _stat_rows(t, r, name, label, header)
        disagg = [(label, k) for label, k in _DISAGG_ROWS if r.get(k) is not None]
        if disagg:  # a disaggregated deployment (see bench.server_metrics.disagg_stats)
            t.add_section()
            t.add_row("[bold]Disaggregation[/]", "")
            for label, k in disagg:
                t.add_row(label, _fmt(r[k]))
        if "spec_decode_acceptance_rate" in r:
            t.add_section()
            t.add_row("[bold]Speculative decoding[/]", "")
            t.add_row("Acceptance rate (%)", _fmt(r["spec_decode_acceptance_rate"]))
            t.add_row("Acceptance length", _fmt(r["spec_decode_acceptance_length"]))
        return t
    if mode == "throughput":
        t = _table("offline throughput result")
        for label, k in (("Requests", "num_requests"), ("Elapsed time (s)", "elapsed_time"),
                         ("Total input tokens", "total_input_tokens"), ("Total output tokens", "total_output_tokens"),
                         ("Request throughput (req/s)", "requests_per_second"),
                         ("Output token throughput (tok/s)", "output_tokens_per_second"),
                         ("Total token throughput (tok/s)", "tokens_per_second")):
            t.add_row(label, _fmt(r.get(k)))
        return t
    if mode == "latency":
        t = _table("offline latency result")
        t.add_row("Batch size / input len / output len", f"{r['batch_size']} / {r['input_len']} / {r['output_len']}")
        t.add_row("Timed iterations (after warm-up)", f"{r['num_iters']} (after {r['num_iters_warmup']})")
        t.add_row("Avg latency per iteration (s)", _fmt(r["avg_latency"], 4))
        for p, v in r["percentiles"].items():
            t.add_row(f"P{p} latency per iteration (s)", _fmt(v, 4))
        for name, label, header in METRICS[:2]:
            _stat_rows(t, r, name, label, header)
        return t
    raise ValueError(f"unknown benchmark result mode {mode!r}")


def error_summary(result: dict[str, Any], limit: int = 5) -> list[str]:
    """The most frequent distinct errors of the failed requests, with counts."""
    errors = Counter(e.strip().splitlines()[-1] for e in result.get("errors", []) if e and e.strip())
    return [f"{n} × {e}" for e, n in errors.most_common(limit)]


def print_result(result: dict[str, Any], console=None) -> None:
    from nvllm.kernels.report import format_table
    from nvllm.logger import results_console

    out = console or results_console()
    out.print(results_table(result))
    if result.get("mode") == "serve" and result.get("failed"):
        out.print(f"[bold red]{result['failed']} of {result['num_prompts']} requests failed:[/]", highlight=False)
        for line in error_summary(result):
            out.print(f"  {line}", highlight=False, markup=False)
    report = result.get("kernel_report")
    if report:
        out.print(format_table(report))
    elif result.get("mode") == "serve" and report is None:
        out.print("[dim]the server exposes no kernel report (GET /v1/kernel_report)[/]")


def save_result(result: dict[str, Any], path: str) -> None:
    """Write the JSON whole or not at all (``nvllm.output_file``). A number JSON cannot hold (an infinite or NaN
    float) is written as its text, "inf" as request_rate's is, so that a finished run is never lost to it."""
    output_file.write_json(path, _json_safe(result))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def load_result(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"result file {path} {missing(path)}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a benchmark result (not valid JSON: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a benchmark result (expected a JSON object)")
    if data.get("mode") not in ("serve", "throughput", "latency", "advise"):
        raise ValueError(f"{path} is not a benchmark result (no 'mode' of serve, throughput, latency or advise, "
                         "as `nvllm bench ... --save-result` writes)")
    return data


def _scalars(result: dict[str, Any]) -> dict[str, float]:
    """Numeric scalars, one level of nested dicts flattened ("percentiles.50"); lists and reports skipped."""
    out: dict[str, float] = {}
    for k, v in result.items():
        if k in ("kernel_report", "server_metrics_delta"):
            continue
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()
                        if isinstance(vv, (int, float)) and not isinstance(vv, bool)})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    if result.get("mode") == "latency":  # per-iteration latencies are in seconds: shown in ms, as TTFT/TPOT are
        out = {(f"{k} (ms)" if _seconds(k) else k): (v * 1000.0 if _seconds(k) else v) for k, v in out.items()}
    return out


def _seconds(key: str) -> bool:
    return key == "avg_latency" or key.startswith("percentiles.")


def compare_tables(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> list[Table]:
    """Side by side: every numeric result of either file, and B/A where both measured it."""
    sa, sb = _scalars(a), _scalars(b)
    t = Table(title=f"{name_a} vs {name_b}", title_justify="left")
    t.add_column("metric")
    t.add_column(name_a, justify="right")
    t.add_column(name_b, justify="right")
    t.add_column("B / A", justify="right")
    for k in list(sa) + [k for k in sb if k not in sa]:
        va, vb = sa.get(k), sb.get(k)
        ratio = f"{vb / va:.3f}×" if va not in (None, 0) and vb is not None else "n/a"
        t.add_row(k, _fmt(va), _fmt(vb), ratio)
    tables = [t]
    ka, kb = a.get("kernel_report") or {}, b.get("kernel_report") or {}
    if ka or kb:
        k = Table(title="kernel report (calls)", title_justify="left")
        for col, just in (("op", "left"), ("implementation", "left"), (name_a, "right"), (name_b, "right")):
            k.add_column(col, justify=just)
        for op in sorted(set(ka) | set(kb)):
            for impl in sorted(set(ka.get(op, {})) | set(kb.get(op, {}))):
                k.add_row(op, impl, _fmt(ka.get(op, {}).get(impl)), _fmt(kb.get(op, {}).get(impl)))
        tables.append(k)
    return tables


def finish(result: dict[str, Any], save_path: str | None) -> None:
    """Print the result (and the kernel report) and save it when asked."""
    from nvllm.logger import console

    print_result(result)
    if save_path:
        save_result(result, save_path)
        console().print(f"saved {save_path}", highlight=False)
