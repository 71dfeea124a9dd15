"""Figures a benchmark derives from the change of a server's Prometheus counters over the run (the delta that
`bench serve` keeps as `server_metrics_delta`: every `*_total`, `*_sum` and `*_count` sample, labels in the key).

disagg_stats: a disaggregated deployment (nvllm router, or one of its workers) — the TTFT split into the
prefill stage, the handoff and (after the first token) the KV transfer and the first decode step, the KV
bytes and transfer bandwidth, the mean queue lengths on each side, failures and recomputed prompts.
step_stats: an engine's steps by kind (decode-only, prefill-only, mixed), for the disaggregation advisor."""

from __future__ import annotations

import re

_LABEL = re.compile(r'(\w+)="([^"]*)"')


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The samples that changed between two reads of the counters, as after − before."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _name(key: str) -> str:
    return key.split("{", 1)[0]


def _labels(key: str) -> dict[str, str]:
    return dict(_LABEL.findall(key.partition("{")[2]))


def total(delta: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a series over every label set matching `labels` (model_name and the like summed over)."""
    return sum(v for k, v in delta.items()
               if _name(k) == name and all(_labels(k).get(n) == want for n, want in labels.items()))


def by_label(delta: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in delta.items():
        if _name(k) == name and label in _labels(k):
            key = _labels(k)[label]
            out[key] = out.get(key, 0.0) + v
    return out


def _mean_ms(delta: dict[str, float], seconds: str, count: str) -> float | None:
    n = total(delta, count)
    return 1000.0 * total(delta, seconds) / n if n else None


def disagg_stats(delta: dict[str, float], duration: float) -> dict[str, float]:
    """The disaggregation figures of a run, or {} when the server exposes none."""
    out: dict[str, float] = {}
    for key, base in (("prefill", "nvllm:router_prefill_seconds"), ("handoff", "nvllm:router_handoff_seconds")):
        v = _mean_ms(delta, f"{base}_sum", f"{base}_count")
        if v is not None:
            out[f"disagg_mean_{key}_ms"] = v
    transfers = total(delta, "nvllm:kv_transfers_total", outcome="ok")
    if transfers:
        nbytes, secs = total(delta, "nvllm:kv_transfer_bytes_total"), total(delta, "nvllm:kv_transfer_seconds_total")
        out.update(disagg_kv_transfers=transfers, disagg_kv_bytes=nbytes, disagg_kv_mb=nbytes / 1e6,
                   disagg_mean_kv_transfer_ms=1000.0 * secs / transfers,
                   disagg_kv_transfer_gb_per_s=nbytes / secs / 1e9 if secs > 0 else None)
        out["disagg_kv_transfers_failed"] = total(delta, "nvllm:kv_transfers_total", outcome="failed")
        for phase in ("ask", "wire", "copy", "queue", "gather", "send"):  # where the time went (decode side, then
            # the prefill side: the decode side's wire phase holds all of the prefill side's)
            secs = total(delta, "nvllm:kv_transfer_phase_seconds_total", phase=phase)
            if secs:
                out[f"disagg_mean_kv_{phase}_ms"] = 1000.0 * secs / transfers
    v = _mean_ms(delta, "nvllm:disagg_first_decode_seconds_total", "nvllm:disagg_first_decodes_total")
    if v is not None:
        out["disagg_mean_first_decode_ms"] = v
    if out:  # a disaggregated run: what did not happen is a 0 (the delta leaves unchanged counters out)
        out["disagg_kv_recomputed"] = total(delta, "nvllm:kv_recomputed_total")
        out["disagg_worker_failures"] = total(delta, "nvllm:router_failures_total")
    for k, v in delta.items():
        if _name(k) == "nvllm:router_queue_request_seconds_total" and duration > 0:
            lbl = _labels(k)
            out[f"disagg_mean_{lbl.get('role')}_{lbl.get('state')}"] = v / duration
    return {k: v for k, v in out.items() if v is not None}


def step_stats(delta: dict[str, float]) -> dict[str, float] | None:
    """Engine steps of the run by kind: mean step times, how much a prefill stretches a decode step, and the
    share of the engine's time spent computing prompts. None when the server does not count its steps."""
    steps = by_label(delta, "nvllm:engine_steps_total", "kind")
    secs = by_label(delta, "nvllm:engine_step_seconds_total", "kind")
    if not steps or not sum(steps.values()):
        return None
    n = {k: steps.get(k, 0.0) for k in ("decode", "prefill", "mixed")}
    s = {k: secs.get(k, 0.0) for k in ("decode", "prefill", "mixed")}
    decode_ms = 1000.0 * s["decode"] / n["decode"] if n["decode"] else None
    mixed_ms = 1000.0 * s["mixed"] / n["mixed"] if n["mixed"] else None
    total_s = sum(s.values())
    # prompt work: prefill-only steps, plus what mixed steps took beyond a decode step
    prompt_s = s["prefill"] + (max(0.0, s["mixed"] - n["mixed"] * decode_ms / 1000.0) if decode_ms else s["mixed"])
    decoding_steps = n["decode"] + n["mixed"]
    inflation = ((s["decode"] + s["mixed"]) / (decoding_steps * decode_ms / 1000.0)
                 if decode_ms and decoding_steps else None)
    return {"steps": sum(n.values()), "decode_step_ms": decode_ms, "mixed_step_ms": mixed_ms,
            "mixed_step_ratio": mixed_ms / decode_ms if mixed_ms and decode_ms else None,
            "tpot_inflation": inflation, "prefill_share": prompt_s / total_s if total_s > 0 else None}
