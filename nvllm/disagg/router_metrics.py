"""The router's Prometheus metrics and its periodic log line.

Measured by the router, per request: the prefill stage (arrival → the prefill worker's handoff), the handoff
(→ the decode worker's answer begins), time to first token (arrival → the first event from the decode
worker), end-to-end latency; requests by outcome and failures by worker and stage. Read from the workers'
/internal/info at scrape time: up, in flight and queued per worker, the request-seconds spent queued on each
side, and the decode workers' KV transfer counters summed (bytes, seconds, outcomes, recomputes, first
decodes) — the names a worker uses, so a benchmark reads the same series from either."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nvllm.disagg.metrics import PHASES, SEND_PHASES, phase_seconds
from nvllm.disagg.worker_pool import WorkerPool
from nvllm.serve.metrics import E2E_BUCKETS, TTFT_BUCKETS

logger = logging.getLogger("nvllm")

# decode-side transfer counters summed over workers: (metric, /internal/info key, help)
_SUMMED = (("kv_transfer_bytes", "bytes", "KV bytes the decode workers received."),
           ("kv_transfer_seconds", "seconds", "Seconds the decode workers spent on KV transfers."),
           ("kv_recomputed", "recomputed", "Prompts recomputed on a decode worker (KV not fetched)."),
           ("disagg_first_decode_seconds", "first_decode_seconds", "Seconds from KV arrival to the next token."),
           ("disagg_first_decodes", "first_decodes", "First decodes timed."))


class _PoolCollector:
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self):
        pool = self.pool
        per_worker = {name: GaugeMetricFamily(f"nvllm:router_worker_{name}", doc, labels=["role", "worker"])
                      for name, doc in (("up", "1 when the worker answers."),
                                        ("in_flight", "Requests the router has in flight on the worker."),
                                        ("requests_waiting", "Requests queued on the worker (last poll)."),
                                        ("requests_running", "Requests running on the worker (last poll)."),
                                        ("kv_cache_usage_perc", "The worker's KV-cache usage (last poll)."))}
        for w in pool.workers:
            labels = [w.role, w.url]
            per_worker["up"].add_metric(labels, 1.0 if w.up else 0.0)
            per_worker["in_flight"].add_metric(labels, w.in_flight)
            per_worker["requests_waiting"].add_metric(labels, w.info.get("waiting", 0))
            per_worker["requests_running"].add_metric(labels, w.info.get("running", 0))
            per_worker["kv_cache_usage_perc"].add_metric(labels, w.info.get("kv_cache_usage", 0.0))
        yield from per_worker.values()
        q = CounterMetricFamily("nvllm:router_queue_request_seconds", "Request-seconds queued (waiting) or running "
                                "on each side; over a run, divided by its duration: the mean queue length.",
                                labels=["role", "state"])
        for (role, state), v in sorted(pool.queue_seconds.items()):
            q.add_metric([role, state], v)
        yield q
        decode = [w.info.get("transfer", {}) for w in pool.of("decode")]
        prefill = [w.info.get("transfer", {}) for w in pool.of("prefill")]
        yield phase_seconds([(p, sum(t.get(f"{p}_seconds", 0.0) for t in decode)) for p in PHASES]
                            + [(p, sum(t.get(f"{p}_seconds", 0.0) for t in prefill)) for p in SEND_PHASES])
        for name, key, doc in _SUMMED:
            c = CounterMetricFamily(f"nvllm:{name}", doc)
            c.add_metric([], sum(t.get(key, 0) for t in decode))
            yield c
        c = CounterMetricFamily("nvllm:kv_transfers", "KV transfers the decode workers received, by outcome.",
                                labels=["outcome"])
        c.add_metric(["ok"], sum(t.get("transfers_ok", 0) for t in decode))
        c.add_metric(["failed"], sum(t.get("transfers_failed", 0) for t in decode))
        yield c
        c = CounterMetricFamily("nvllm:kv_handles_expired", "Prefilled KV released unfetched after a timeout.")
        c.add_metric([], sum(w.info.get("transfer", {}).get("expired", 0) for w in pool.of("prefill")))
        yield c


class RouterMetrics:
    def __init__(self, pool: WorkerPool):
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        r = self.registry
        self.prefill = Histogram("nvllm:router_prefill_seconds", "Arrival to the prefill worker's handoff.",
                                 buckets=TTFT_BUCKETS, registry=r)
        self.handoff = Histogram("nvllm:router_handoff_seconds",
                                 "Prefill handoff to the decode worker's answer (streamed requests).",
                                 buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("nvllm:router_time_to_first_token_seconds",
                              "Arrival to the first event of the answer (streamed requests).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("nvllm:router_e2e_request_latency_seconds", "Arrival to the end of the answer.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("nvllm:router_requests", "Requests by outcome (ok, client_error, failed, "
                                "client_gone).", ["outcome"], registry=r)
        self.failures = Counter("nvllm:router_failures", "Worker failures seen by the router.",
                                ["role", "worker", "stage"], registry=r)
        self.pool = pool
        self.done = 0  # requests answered, every outcome
        self._last = (time.monotonic(), 0, 0.0)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.done += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> None:
        """requests/s, per-side in-flight and queues, KV throughput and failures since the last line."""
        now, pool = time.monotonic(), self.pool
        done = self.done
        kv = sum(w.info.get("transfer", {}).get("bytes", 0) for w in pool.of("decode"))
        t, prev_done, prev_kv = self._last
        dt = max(now - t, 1e-9)
        sides = []
        for role in ("prefill", "decode", "mixed"):
            ws = pool.of(role)
            if ws:
                sides.append(f"{role} {sum(w.up for w in ws)}/{len(ws)} up, in flight "
                             f"{sum(w.in_flight for w in ws)}, waiting {sum(w.info.get('waiting', 0) for w in ws)}")
        logger.info("router: %.2f req/s; %s; KV %.1f MB/s; failures %d", (done - prev_done) / dt, "; ".join(sides),
                    (kv - prev_kv) / dt / 1e6, sum(w.failures for w in pool.workers))
        self._last = (now, done, kv)
