"""`nvllm bench advise`: measure a workload on a mixed server and say whether to serve it disaggregated.

The run is an ordinary `bench serve` run (the dataset at the given rate or concurrency) against a mixed server.
From its client side come the prompt and output length distributions, the request rate, the mean number of
requests in flight, TTFT, TPOT and ITL; from the server's /metrics (an nvllm server counts its engine steps by
kind) how much longer a step with prompt tokens takes than a decode-only one — what a prefill adds to the time
per output token of the requests decoding beside it — and the share of the engine's time spent on prompts.
A server without those counters is measured from the client alone: the ITL p99/p50 ratio stands for the stretch.
The verdict comes from nvllm.disagg.advisor's decision table."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import numpy as np

from nvllm.bench.datasets import SampleRequest
from nvllm.bench.serve import ServeOptions, run_serve_benchmark
from nvllm.bench.server_metrics import step_stats
from nvllm.disagg.advisor import Recommendation, Workload, recommend

logger = logging.getLogger("nvllm")


def local_gpu_count() -> int:
    """This host's CUDA devices; on a host with none, 1 and a warning (the advice is for the serving host)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    logger.warning("no CUDA device on this host to count: advising for 1 GPU; pass --num-gpus with the serving "
                   "host's count")
    return 1


def workload_from(result: dict[str, Any], num_gpus: int) -> Workload:
    """The advisor's measurements from a `bench serve` result (percentiles 50, 90 and 99 wanted)."""
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    if not ok:
        raise ValueError("no request succeeded: nothing to measure")
    prompts = np.array([result["input_lens"][i] for i in ok], dtype=float)
    outputs = np.array([result["output_lens"][i] for i in ok], dtype=float)
    latencies = [result["latencies"][i] for i in ok]
    w = Workload(num_requests=len(ok), prompt_len_p50=float(np.percentile(prompts, 50)),
                 prompt_len_p90=float(np.percentile(prompts, 90)), prompt_len_p99=float(np.percentile(prompts, 99)),
                 output_len_p50=float(np.percentile(outputs, 50)), output_len_p90=float(np.percentile(outputs, 90)),
                 request_rate=result["request_throughput"], mean_in_flight=sum(latencies) / result["duration"],
                 num_gpus=num_gpus, ttft_p99_ms=result.get("p99_ttft_ms"), tpot_p99_ms=result.get("p99_tpot_ms"),
                 itl_p50_ms=result.get("p50_itl_ms"), itl_p99_ms=result.get("p99_itl_ms"))
    steps = step_stats(result.get("server_metrics_delta") or {})
    if steps is not None and steps["tpot_inflation"] is not None:
        w.decode_step_ms, w.mixed_step_ms = steps["decode_step_ms"], steps["mixed_step_ms"]
        w.tpot_inflation, w.prefill_share = steps["tpot_inflation"], steps["prefill_share"]
    elif w.itl_p50_ms:
        w.tpot_inflation, w.inflation_source = w.itl_p99_ms / w.itl_p50_ms, "client ITL p99/p50"
    return w


def run_advise(opts: ServeOptions, requests: list[SampleRequest], tokenizer, num_gpus: int | None
               ) -> tuple[dict[str, Any], Workload, Recommendation]:
    """Run the measurement; the result JSON (mode "advise"), the workload and the recommendation."""
    opts.percentiles = sorted(set(opts.percentiles) | {50.0, 90.0, 99.0})
    bench = run_serve_benchmark(opts, requests, tokenizer)
    workload = workload_from(bench, num_gpus or local_gpu_count())
    rec = recommend(workload)
    keep = ("base_url", "model_id", "num_prompts", "request_rate", "max_concurrency", "duration", "completed",
            "failed", "request_throughput", "output_throughput")
    result = {"mode": "advise", "date": bench["date"], "workload": asdict(workload), "recommendation": asdict(rec),
              "bench": {k: bench[k] for k in keep if k in bench}}
    return result, workload, rec
