"""Prefill/decode disaggregation: prefill workers compute prompts, decode workers generate, and each request's
KV cache moves between them over torch.distributed (docs/DISAGG.md).

config.py          DisaggConfig: a server's role, its place in the KV transfer group, the xPyD launch
options.py         the `nvllm serve` flags (Disaggregation panel)
staging.py         a sequence's blocks (every layer, K and V, scales) as one contiguous byte buffer, and back
transfer_group.py  the standalone gloo / NCCL process group over all workers; one transfer = header + payload
weights_fingerprint.py  a digest of the weights a worker serves, compared at the group's start-up
handoff.py         the control messages between router and workers (JSON: token ids, handles, ranks)
transfer_thread.py the thread a worker runs its KV transfers on, in order
kv_sender.py       the prefill worker's transfer thread
kv_receiver.py     the decode worker's transfer thread (falls back to recomputing the prompt)
worker.py          the internal routes a prefill or decode worker adds to the OpenAI server
metrics.py         transfer counters: /metrics, /internal/info, the log line
worker_pool.py     the router's view of its workers: health, load, least-loaded picking
router.py          `nvllm router`: one OpenAI endpoint in front of the workers (or of mixed replicas)
router_app.py      the router's FastAPI app and process
router_config.py   the router's settings
response_owners.py which worker holds which stored response (the Responses API's follow-ups)
router_metrics.py  the router's /metrics and log line
launcher.py        `nvllm serve --disaggregate xPyD`: the workers and the router as one command
advisor.py         the decision table behind `nvllm bench advise`
"""
