"""Benchmarks: `nvllm bench serve` (any OpenAI-compatible server, over streaming HTTP), `bench throughput`
and `bench latency` (offline, through `LLM`), `bench compare` (two saved results side by side), `bench advise`
(serve a workload disaggregated or not).

cli.py             the `nvllm bench` commands
metrics.py         vLLM's serving-benchmark metric definitions (TTFT, TPOT, ITL, E2EL, throughput, goodput)
arrivals.py        gamma-distributed request arrivals (burstiness 1 = Poisson)
datasets.py        random / ShareGPT / jsonl / GSM8K prompts
serve.py           the async load generator
server_metrics.py  figures from the change of a server's Prometheus counters over a run
offline.py         throughput and latency through the engine
report.py          results table, JSON save, compare
advise.py          `bench advise`: a `bench serve` run on a mixed server and the disaggregation decision
"""
