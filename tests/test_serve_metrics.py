"""/metrics of the real server (a subprocess on a free port, the demo model): the families vLLM exports, under
`nvllm:` names, parsed with prometheus-client's own parser."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import metrics, start_server, stop_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_metrics") / "server.log"
    proc, base = start_server(["--async-scheduling", "--max-model-len", "256", "--device", "cpu",
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], log_path)
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c
    stop_server(proc)


def test_metrics_parse(http):
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert families[f"nvllm:{name}"].type == "gauge"
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "prompt_tokens_by_source", "prompt_tokens_cached", "generation_tokens", "request_success"):
        assert families[f"nvllm:{name}"].type == "counter"
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        family = families[f"nvllm:{name}"]
        assert family.type == "histogram"
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        assert count > 0
    m = metrics(http)
    assert m["nvllm:generation_tokens_total"] > 0 and m["nvllm:prefix_cache_queries_total"] > 0
    assert {"stop", "length", "abort"} <= {k[len("nvllm:request_success_total["):-1] for k in m
                                           if k.startswith("nvllm:request_success_total[")}  # there from the start
    assert json.loads(json.dumps(m))  # plain numbers


def test_per_request_histograms_as_vllm_exports_them(http):
    """A finished request's phases, mean time per output token and sizes, in vLLM's histograms (its Grafana
    dashboard reads them), and the cache settings as labels."""
    def hist(name: str) -> tuple[float, float]:
        family = families[f"nvllm:{name}"]
        assert family.type == "histogram", name
        return tuple(next(x.value for x in family.samples if x.name.endswith(suffix)) for suffix in ("_count", "_sum"))

    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    names = ["request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
             "request_inference_time_seconds", "request_time_per_output_token_seconds", "request_prompt_tokens",
             "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n"]
    before = {n: hist(n) for n in names}
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "n": 2, "ignore_eos": True}).json()
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    after = {n: hist(n) for n in names}
    added = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert all(count == 1 for count, _ in added.values()), added
    assert added["request_prompt_tokens"][1] == r["usage"]["prompt_tokens"]
    assert added["request_generation_tokens"][1] == r["usage"]["completion_tokens"] == 12
    assert added["request_max_num_generation_tokens"][1] == 6 and added["request_params_n"][1] == 2
    phases = {n: added[f"request_{n}_time_seconds"][1] for n in ("queue", "prefill", "decode", "inference")}
    assert all(v >= 0 for v in phases.values()) and phases["inference"] >= phases["decode"]
    assert abs(added["request_time_per_output_token_seconds"][1] - phases["decode"] / 5) < 1e-6
    tpot = hist("request_time_per_output_token_seconds")  # a one-token request counts, at 0, as vLLM records it
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert hist("request_time_per_output_token_seconds") == (tpot[0] + 1, tpot[1])
    info = families["nvllm:cache_config_info"].samples[0]
    assert info.value == 1 and int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 0
