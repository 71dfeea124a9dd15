"""A worker's KV-transfer statistics: counted by the transfer threads, shown in /metrics (nvllm:kv_*, nvllm:disagg_*),
in /internal/info (which the router polls and sums over workers) and in a periodic log line.

Prefill side: transfers sent (bytes, seconds from taking the blocks to the last byte sent, and by phase:
``queue`` — the job waiting for the send thread, ``gather`` — the staging copy, ``send`` — header and payload on
the wire), handles expired.
Decode side: transfers received (bytes, seconds from asking the prefill worker to the blocks written, and those
seconds by phase: ``ask`` — the HTTP call until the prefill worker queued the send, ``wire`` — the receive,
``copy`` — writing the blocks into the pool), prompts recomputed here because their KV could not be fetched, and
the first decode: seconds from the KV's arrival to the request's next token."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nvllm.outputs import RequestOutput

logger = logging.getLogger("nvllm")


@dataclass
class TransferStats:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    recomputed: int = 0  # decode side: prompts recomputed here (KV not fetched)
    expired: int = 0  # prefill side: handles nobody fetched in time
    first_decodes: int = 0
    first_decode_seconds: float = 0.0
    ask_seconds: float = 0.0  # decode side, successful transfers: the phases of ``seconds`` (see above)
    wire_seconds: float = 0.0
    copy_seconds: float = 0.0
    queue_seconds: float = 0.0  # prefill side, successful transfers: the phases of ``seconds`` (see above)
    gather_seconds: float = 0.0
    send_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _arrived: dict[str, float] = field(default_factory=dict, repr=False)  # request id → KV arrival (decode side)

    def transfer(self, ok: bool, nbytes: int = 0, seconds: float = 0.0, phases: dict[str, float] | None = None
                 ) -> None:
        """One transfer; ``phases``: its seconds by phase (``PHASES`` on the decode side, ``SEND_PHASES`` on the
        prefill side)."""
        with self._lock:
            if ok:
                self.transfers_ok += 1
                self.bytes += nbytes
                self.seconds += seconds
                for phase, secs in (phases or {}).items():
                    setattr(self, f"{phase}_seconds", getattr(self, f"{phase}_seconds") + secs)
            else:
                self.transfers_failed += 1

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def kv_arrived(self, request_id: str) -> None:
        with self._lock:
            self._arrived.setdefault(request_id, time.time())

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Engine output hook: the first token decoded after a request's KV arrived ends its first decode."""
        with self._lock:
            for out in outputs:
                t = self._arrived.get(out.request_id)
                if t is None:
                    continue
                last = out.metrics.last_token_time
                if last is not None and last >= t and any(len(c.token_ids) > 1 for c in out.outputs):
                    self.first_decodes += 1
                    self.first_decode_seconds += last - t
                    del self._arrived[out.request_id]
                elif out.finished:
                    del self._arrived[out.request_id]

    def snapshot(self) -> dict:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


PHASES = ("ask", "wire", "copy")  # a transfer received (decode side)
SEND_PHASES = ("queue", "gather", "send")  # a transfer sent (prefill side)


def phase_seconds(values, label_names: list[str] = (), label_values: list[str] = ()) -> CounterMetricFamily:
    """nvllm:kv_transfer_phase_seconds{…, phase}: transfer seconds by phase, both sides (the phase names differ)."""
    c = CounterMetricFamily("nvllm:kv_transfer_phase_seconds", "Seconds of the KV transfers by phase. Received: ask "
                            "(HTTP to the prefill worker), wire (the receive), copy (into the KV pool); sent: queue "
                            "(waiting for the send thread), gather (the staging copy), send (on the wire).",
                            labels=[*label_names, "phase"])
    for phase, v in values:
        c.add_metric([*label_values, phase], v)
    return c


class TransferCollector:
    """prometheus-client collector reading a TransferStats (and the held / receiving counts) at scrape time."""

    def __init__(self, stats: TransferStats, role: str, model_name: str, gauges):
        self.stats, self.role, self.labels, self.gauges = stats, role, [model_name], gauges

    def collect(self):
        s = self.stats.snapshot()
        lbl = ["model_name"]

        def counter(name: str, doc: str, value: float, extra: dict | None = None):
            c = CounterMetricFamily(f"nvllm:{name}", doc, labels=lbl + list(extra or {}))
            c.add_metric(self.labels + list((extra or {}).values()), value)
            return c

        direction = "sent" if self.role == "prefill" else "received"
        outcomes = CounterMetricFamily("nvllm:kv_transfers", f"KV transfers {direction}, by outcome.",
                                       labels=lbl + ["outcome"])
        outcomes.add_metric(self.labels + ["ok"], s["transfers_ok"])
        outcomes.add_metric(self.labels + ["failed"], s["transfers_failed"])
        yield outcomes
        yield counter("kv_transfer_bytes", f"KV bytes {direction} (blocks, all layers, K and V and scales).",
                      s["bytes"])
        yield counter("kv_transfer_seconds", f"Seconds spent on the KV transfers {direction} (successful ones).",
                      s["seconds"])
        if self.role == "prefill":
            yield counter("kv_handles_expired", "Prefilled KV released unfetched after --kv-handle-timeout.",
                          s["expired"])
            yield phase_seconds([(p, s[f"{p}_seconds"]) for p in SEND_PHASES], lbl, self.labels)
        else:
            yield counter("kv_recomputed", "Prompts recomputed on this decode worker: their KV was not fetched.",
                          s["recomputed"])
            yield phase_seconds([(p, s[f"{p}_seconds"]) for p in PHASES], lbl, self.labels)
            yield counter("disagg_first_decode_seconds", "Seconds from a request's KV arrival to its next token.",
                          s["first_decode_seconds"])
            yield counter("disagg_first_decodes", "First decodes timed (see disagg_first_decode_seconds).",
                          s["first_decodes"])
        for name, doc, fn in self.gauges:
            g = GaugeMetricFamily(f"nvllm:{name}", doc, labels=lbl)
            g.add_metric(self.labels, fn())
            yield g


class TransferLogger:
    """One log line every `interval` seconds while transfers happen."""

    def __init__(self, stats: TransferStats, role: str, interval: float):
        self.stats, self.role, self.interval = stats, role, interval
        self._last_time, self._last = time.monotonic(), stats.snapshot()

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last_time < self.interval:
            return
        s, prev = self.stats.snapshot(), self._last
        n = s["transfers_ok"] - prev["transfers_ok"]
        failed = s["transfers_failed"] - prev["transfers_failed"]
        if n or failed:
            mb = (s["bytes"] - prev["bytes"]) / 1e6
            secs = s["seconds"] - prev["seconds"]
            logger.info("KV %s: %d transfers, %.1f MB, %.2f ms mean, %.2f GB/s while transferring, %d failed",
                        "sent" if self.role == "prefill" else "received", n, mb, 1000 * secs / max(n, 1),
                        mb / 1000 / secs if secs > 0 else 0.0, failed)
        self._last_time, self._last = now, s
