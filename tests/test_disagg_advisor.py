"""The disaggregation advisor's decision table on synthetic measurements, and the figures the benchmark derives from
a server's counters (engine steps by kind; a disaggregated deployment's TTFT split and KV transfer). The live
run against a demo server is in test_disagg.py, which has one running."""

from __future__ import annotations

import pytest
from rich.console import Console

from nvllm.bench.advise import workload_from
from nvllm.bench.server_metrics import disagg_stats, step_stats
from nvllm.disagg.advisor import Workload, recommend, split, tables


def _w(prompt: float, in_flight: float, gpus: int = 2, inflation: float | None = None,
       share: float | None = None) -> Workload:
    return Workload(num_requests=100, prompt_len_p50=prompt, prompt_len_p90=prompt * 1.5, prompt_len_p99=prompt * 2,
                    output_len_p50=200, output_len_p90=300, request_rate=4.0, mean_in_flight=in_flight,
                    num_gpus=gpus, tpot_inflation=inflation, prefill_share=share)


def test_short_prompts_at_low_load_stay_mixed():
    r = recommend(_w(300, 3, gpus=2, inflation=1.1, share=0.05))
    assert r.verdict == "stay mixed" and "short prompts" in r.reasons[0]
    assert "router --mixed" in r.command  # two GPUs: one mixed replica each
    assert any("1.10x" in x for x in r.reasons)  # the numbers behind it are shown


def test_long_prompts_at_high_concurrency_disaggregate_split_by_gpu():
    r = recommend(_w(3000, 40, gpus=2, inflation=2.0, share=0.4))
    assert r.verdict == "disaggregate" and "long prompts" in r.reasons[0]
    assert (r.prefill_workers, r.decode_workers) == (1, 1) and "--disaggregate 1P1D" in r.command
    r8 = recommend(_w(3000, 64, gpus=8, share=0.4))
    assert (r8.prefill_workers, r8.decode_workers) == (3, 5) and "3P5D" in r8.command


def test_one_gpu_cannot_split():
    r = recommend(_w(3000, 40, gpus=1, inflation=2.0, share=0.3))
    assert r.verdict == "stay mixed" and any("GPU per worker" in x for x in r.reasons)
    assert r.command == "nvllm serve …"


@pytest.mark.parametrize("inflation,share,verdict", [(1.6, 0.3, "disaggregate"), (1.1, 0.3, "stay mixed"),
                                                     (1.6, 0.05, "stay mixed"), (None, None, "stay mixed")])
def test_middle_ground_is_decided_by_the_measurement(inflation, share, verdict):
    r = recommend(_w(1000, 10, gpus=4, inflation=inflation, share=share))
    assert r.verdict == verdict
    assert "thresholds" in r.reasons[0] or "not measured" in r.reasons[0]


def test_split_ratio():
    assert split(2, 0.9) == (1, 1) and split(8, 0.25) == (2, 6) and split(8, 0.01) == (1, 7)
    assert split(1, 0.5) == (1, 1) and split(6, None) == (3, 3)


def test_tables_render():
    w = _w(2500, 20, gpus=2, inflation=1.8, share=0.35)
    console = Console(record=True, width=160)
    for t in tables(w, recommend(w)):
        console.print(t)
    text = console.export_text()
    assert "disaggregate" in text and "1:1" in text and "1.80x" in text and "35%" in text


def _delta(kind_steps: dict, kind_seconds: dict) -> dict:
    d = {}
    for k, v in kind_steps.items():
        d[f'nvllm:engine_steps_total{{kind="{k}",model_name="m"}}'] = v
    for k, v in kind_seconds.items():
        d[f'nvllm:engine_step_seconds_total{{kind="{k}",model_name="m"}}'] = v
    return d


def test_step_stats():
    # 100 decode-only steps of 10 ms, 20 mixed steps of 30 ms, 5 prefill-only steps of 40 ms
    s = step_stats(_delta({"decode": 100, "mixed": 20, "prefill": 5}, {"decode": 1.0, "mixed": 0.6, "prefill": 0.2}))
    assert s["decode_step_ms"] == pytest.approx(10) and s["mixed_step_ms"] == pytest.approx(30)
    assert s["mixed_step_ratio"] == pytest.approx(3.0)
    assert s["tpot_inflation"] == pytest.approx(1.6 / 1.2)  # 120 decoding steps took 1.6 s instead of 1.2 s
    assert s["prefill_share"] == pytest.approx((0.2 + 0.6 - 0.2) / 1.8)
    assert step_stats({}) is None


def test_disagg_stats_from_router_counters():
    d = {"nvllm:router_prefill_seconds_sum": 2.0, "nvllm:router_prefill_seconds_count": 10.0,
         "nvllm:router_handoff_seconds_sum": 0.1, "nvllm:router_handoff_seconds_count": 10.0,
         'nvllm:kv_transfers_total{outcome="ok"}': 10.0, 'nvllm:kv_transfers_total{outcome="failed"}': 1.0,
         "nvllm:kv_transfer_bytes_total": 4e9, "nvllm:kv_transfer_seconds_total": 0.5,
         "nvllm:disagg_first_decode_seconds_total": 0.2, "nvllm:disagg_first_decodes_total": 10.0,
         'nvllm:router_queue_request_seconds_total{role="decode",state="waiting"}': 30.0,
         "nvllm:kv_recomputed_total": 1.0}
    s = disagg_stats(d, duration=10.0)
    assert s["disagg_mean_prefill_ms"] == pytest.approx(200) and s["disagg_mean_handoff_ms"] == pytest.approx(10)
    assert s["disagg_mean_kv_transfer_ms"] == pytest.approx(50) and s["disagg_kv_transfer_gb_per_s"] == pytest.approx(8)
    assert s["disagg_kv_transfers_failed"] == 1 and s["disagg_mean_first_decode_ms"] == pytest.approx(20)
    assert s["disagg_mean_decode_waiting"] == pytest.approx(3.0) and s["disagg_kv_recomputed"] == 1
    assert s["disagg_worker_failures"] == 0  # reported as 0, not left out
    assert disagg_stats({"nvllm:generation_tokens_total": 5.0}, 1.0) == {}


def test_workload_from_a_result_without_server_counters():
    result = {"errors": ["", "", "boom"], "input_lens": [100, 300, 999], "output_lens": [10, 30, 0],
              "latencies": [1.0, 3.0, None], "duration": 2.0, "request_throughput": 1.0,
              "p99_ttft_ms": 50.0, "p99_tpot_ms": 20.0, "p50_itl_ms": 10.0, "p99_itl_ms": 25.0}
    w = workload_from(result, num_gpus=4)
    assert w.num_requests == 2 and w.prompt_len_p50 == 200 and w.mean_in_flight == 2.0
    assert w.tpot_inflation == 2.5 and w.inflation_source == "client ITL p99/p50" and w.prefill_share is None
    with pytest.raises(ValueError, match="no request succeeded"):
        workload_from({**result, "errors": ["x", "y", "z"]}, 1)


def test_a_host_without_cuda_counts_one_gpu_and_says_so(monkeypatch, caplog):
    import logging

    import torch

    from nvllm.bench.advise import local_gpu_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    log = logging.getLogger("nvllm")  # it does not propagate: listen on it directly
    log.addHandler(caplog.handler)
    try:
        assert local_gpu_count() == 1
    finally:
        log.removeHandler(caplog.handler)
    assert "pass --num-gpus" in caplog.text
