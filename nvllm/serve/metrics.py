"""Prometheus metrics for /metrics, named as vLLM names them with an `nvllm:` prefix.

Gauges and counters are read from the engine when scraped (so they are right even while the engine idles);
the latency histograms are fed by an output hook that runs on the engine thread after every step."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nvllm.engine.llm_engine import LLMEngine
from nvllm.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
# a finished request's phases, as vLLM times them: (name, help, start field, end field of RequestMetrics)
PHASES = (("queue", "Arrival to first scheduling.", "arrival_time", "first_scheduled_time"),
          ("prefill", "First scheduling to the first token.", "first_scheduled_time", "first_token_time"),
          ("decode", "First token to the last.", "first_token_time", "last_token_time"),
          ("inference", "First scheduling to the last token.", "first_scheduled_time", "last_token_time"))


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to ``limit`` (vLLM's buckets for token counts)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > limit:
                return out
            out.append(v)
        exp += 1


class _EngineCollector:
    """Reads the engine's live state at scrape time (plain reads of ints; no lock needed)."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine, self.labels = engine, [model_name]

    def collect(self):
        e, lbl = self.engine, ["model_name"]
        sched, bm, stats = e.scheduler, e.block_manager, e.stats

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"nvllm:{name}", doc, labels=lbl)
            g.add_metric(self.labels, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"nvllm:{name}", doc, labels=lbl)
            c.add_metric(self.labels, value)
            return c

        info = GaugeMetricFamily("nvllm:cache_config_info", "The KV cache's settings (as labels).",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"])
        info.add_metric([str(bm.block_size), str(bm.num_blocks), str(e.config.kv_cache_dtype),
                         str(bm.enable_prefix_caching)], 1)
        yield info
        yield gauge("num_requests_running", "Sequences in the running batch.", len(sched.running))
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", sched.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by live sequences (1 = full).",
                    bm.usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", bm.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", bm.prefix_hits)
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      sched.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of the sequences that began generating (prefix-cache hits "
                      "included).", stats.prompt_tokens)
        by_source = stats.prompt_tokens_by_source
        c = CounterMetricFamily("nvllm:prompt_tokens_by_source", "Prompt tokens, by where their KV came from.",
                                labels=lbl + ["source"])
        for source, v in by_source.items():
            c.add_metric(self.labels + [source], v)
        yield c
        yield counter("prompt_tokens_cached", "Prompt tokens not computed here (prefix-cache hits and received KV).",
                      by_source["local_cache_hit"] + by_source["external_kv_transfer"])
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        prof = e.step_profile  # engine steps by kind: decode-only, prefill-only, mixed (see engine.step_profile)
        for name, doc, values in (
                ("engine_steps", "Engine steps, by what they computed.", prof.steps),
                ("engine_step_seconds", "Wall seconds of engine steps, by what they computed.", prof.seconds),
                ("engine_step_prompt_tokens", "Prompt tokens computed, by the kind of step.", prof.prompt_tokens)):
            c = CounterMetricFamily(f"nvllm:{name}", doc, labels=lbl + ["kind"])
            for kind, v in values.items():
                c.add_metric(self.labels + [kind], v)
            yield c
        if stats.spec is not None:  # speculative decoding (see nvllm.spec.metrics for the definitions)
            sp = stats.spec
            yield counter("spec_decode_num_drafts", "Verifications of a request with drafted tokens.", sp.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Drafted tokens verified.", sp.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", sp.num_accepted_tokens)
            c = CounterMetricFamily("nvllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens accepted, by position in the draft.",
                                    labels=lbl + ["position"])
            cfg = e.spec.spec_config
            for i in range(len(sp.accepted_per_pos) if cfg.auto else cfg.num_speculative_tokens):
                c.add_metric(self.labels + [str(i)], sp.accepted_per_pos[i])
            yield c
        if e.runner.lora is not None:  # vLLM's lora_requests_info: the adapters in use, as labels; the time, as value
            known = e.runner.lora.known

            def names(seqs) -> str:
                return ",".join(sorted({entry.request.lora_name for s in seqs if (entry := known.get(s.lora_id))}))

            g = GaugeMetricFamily("nvllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(e.config.max_loras), names(list(sched.running)), names(sched.waiting_seqs())],
                         time.time())
            yield g


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        lbl = ["model_name"]
        self.ttft = Histogram("nvllm:time_to_first_token_seconds", "Arrival to first generated token.", lbl,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("nvllm:inter_token_latency_seconds", "Time between successive tokens of a request.",
                             lbl, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("nvllm:e2e_request_latency_seconds", "Arrival to the last token (or the abort).",
                             lbl, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("nvllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):  # at 0 from the start, as vLLM's: rate() sees the first one
            self._success.labels(model_name, reason)
        self.phases = {name: Histogram(f"nvllm:request_{name}_time_seconds", doc, lbl, buckets=PHASE_BUCKETS,
                                       registry=self.registry).labels(model_name)
                       for name, doc, _, _ in PHASES}
        self.tpot = Histogram("nvllm:request_time_per_output_token_seconds", "A finished request's decode time over "
                              "its tokens after the first.", lbl, buckets=TPOT_BUCKETS,
                              registry=self.registry).labels(model_name)
        counts = one_two_five_buckets(engine.max_model_len)
        self.sizes = {name: Histogram(f"nvllm:request_{name}", doc, lbl, buckets=buckets,
                                      registry=self.registry).labels(model_name)
                      for name, doc, buckets in (
                          ("prompt_tokens", "A finished request's prompt tokens.", counts),
                          ("generation_tokens", "A finished request's generated tokens (all its samples).", counts),
                          ("max_num_generation_tokens", "A finished request's longest sample.", counts),
                          ("params_n", "A finished request's samples (n).", (1, 2, 5, 10, 20)))}
        self._model_name = model_name
        self._seen: dict[str, tuple[int, float]] = {}  # request id → (tokens so far, time of the last)
        self._lock = threading.Lock()

    def observe(self, outputs: list[RequestOutput]) -> None:
        """The engine-thread hook: one TTFT per request, one ITL per step that added tokens, e2e at the end."""
        with self._lock:
            for out in outputs:
                m = out.metrics
                num = sum(len(c.token_ids) for c in out.outputs)
                prev_num, prev_time = self._seen.get(out.request_id, (0, None))
                if num > prev_num and m.last_token_time is not None:
                    if prev_time is None:
                        if m.ttft is not None:
                            self.ttft.observe(max(0.0, m.ttft))
                    else:
                        self.itl.observe(max(0.0, m.last_token_time - prev_time))
                    self._seen[out.request_id] = (num, m.last_token_time)
                if out.finished:
                    self._seen.pop(out.request_id, None)
                    if m.e2e_latency is not None:
                        self.e2e.observe(max(0.0, m.e2e_latency))
                    self._observe_finished(out)
                    for c in out.outputs:  # no reason: a prefill worker handed it to a decode worker
                        self._success.labels(self._model_name, c.finish_reason or "handed_off").inc()

    def _observe_finished(self, out: RequestOutput) -> None:
        """vLLM's per-request histograms: the phases that happened, the mean time per output token, the sizes."""
        m = out.metrics
        for name, _, start, end in PHASES:
            t0, t1 = getattr(m, start), getattr(m, end)
            if t0 is not None and t1 is not None:
                self.phases[name].observe(max(0.0, t1 - t0))
        lengths = [len(c.token_ids) for c in out.outputs]
        generated = sum(lengths)
        if max(lengths, default=0) > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.observe(max(0.0, m.last_token_time - m.first_token_time) / (max(lengths) - 1))
        else:  # no decode step: 0, as vLLM records it (the count stays the finished requests')
            self.tpot.observe(0.0)
        for name, value in (("prompt_tokens", len(out.prompt_token_ids)), ("generation_tokens", generated),
                            ("max_num_generation_tokens", max(lengths, default=0)), ("params_n", len(lengths))):
            self.sizes[name].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
