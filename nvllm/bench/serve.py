"""`nvllm bench serve`: an async load generator against any OpenAI-compatible server (nvllm, vLLM, SGLang…).

Requests stream over httpx to /v1/completions (or /v1/chat/completions) with `stream_options.include_usage`,
sent at gamma-distributed arrival times (arrivals.py), at most `max_concurrency` in flight. Each request's
client-side timeline becomes a RequestResult (metrics.py); output lengths come from the server's usage.
A failed request (HTTP error, error event in the stream, dropped connection) is counted, its error kept,
and it takes no part in the latency statistics — it is never silently dropped.

Before the run one test request checks the server, the model name and the endpoint (as vLLM does): if it
fails, the run stops with the server's own message. Around the run the client reads the server's kernel
report (GET /v1/kernel_report, where the server has one) and its Prometheus counters (GET /metrics) and
reports their change over the run, with spec-decode acceptance when the server counts drafts.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from nvllm.bench.arrivals import arrival_offsets, describe
from nvllm.bench.datasets import SampleRequest
from nvllm.bench.metrics import RequestResult, calculate_metrics
from nvllm.bench.server_metrics import counter_delta, disagg_stats
from nvllm.disagg.router_config import check_url


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, test request refused): one clear line."""


@dataclass
class ServeOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists
    lora_modules: list[str] = field(default_factory=list)  # adapter names: each request asks for one at random
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0  # greedy unless asked, as vLLM's benchmark sends it: the same tokens to compare
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 6 * 3600.0
    progress: bool = True

    def __post_init__(self) -> None:
        arrival_offsets(0, self.request_rate, self.burstiness)  # raises ValueError on a bad rate or burstiness
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if not 0 <= self.temperature < float("inf"):  # as bench latency says it, before the server is asked
            raise ValueError(f"--temperature must be a finite number of at least 0, got {self.temperature}")
        check_url(self.base_url, "--base-url")  # --host/--port build it when it is not given

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


# ---- one request ---------------------------------------------------------------------------------------
def _error_message(status: int, body: bytes) -> str:
    """`HTTP 404: The model `x` does not exist.` from OpenAI's error object, else the start of the body."""
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        msg = None
    text = msg if isinstance(msg, str) else body.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def build_payload(req: SampleRequest, model: str, opts: ServeOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if opts.chat:
        payload["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if opts.ignore_eos:
        payload["ignore_eos"] = True
    payload["temperature"] = opts.temperature
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int,
                       chat: bool, tokenizer=None) -> RequestResult:
    """Stream one request. As in vLLM's benchmark, every chunk with a choice is a step of output, its text empty
    or not: a request that ends on EOS or a stop token ends with a chunk that carries only the finish_reason, and
    the step that produced that token counts in E2EL, TPOT and ITL. Only the chat role chunk, which this server
    sends before any token, is skipped."""
    out = RequestResult(prompt_len=prompt_len)
    text: list[str] = []
    out.start_time = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                out.error = _error_message(resp.status_code, await resp.aread())
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (": ping"), event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    out.error = "error event: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    # the output as the server counted it; the prompt stays the dataset's count (--tokenizer), as
                    # vLLM's benchmark keeps it, whatever the server adds to it (a chat endpoint's template)
                    out.output_tokens = usage.get("completion_tokens", out.output_tokens)
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}) if chat else choice
                    piece = delta.get("content" if chat else "text")
                    if not piece and chat and "role" in delta:
                        continue
                    if out.ttft is None:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(piece or "")
                    break  # one choice per request (n = 1)
    except Exception as e:  # any failure of one request (transport, malformed stream) fails that request only
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return out
    out.generated_text = "".join(text)
    if out.ttft is None:
        out.error = "the stream ended without a content chunk"
        return out
    out.latency = last - out.start_time
    if not out.output_tokens and tokenizer is not None:  # a server that sends no usage
        out.output_tokens = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    out.success = True
    return out


# ---- server side: models, kernel report, Prometheus counters ---------------------------------------------
QUERY_TIMEOUT_S = 30.0
"""How long the model list, the kernel report and /metrics may take: a server that accepts connections but never
answers fails the run at its start instead of hanging it (the requests themselves get ``timeout_s``)."""

async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models", timeout=QUERY_TIMEOUT_S)
    if resp.status_code != 200:
        raise BenchError(f"{base_url}/v1/models answered {_error_message(resp.status_code, resp.content)}")
    try:
        models = [m.get("id") for m in resp.json().get("data", [])]
    except (ValueError, AttributeError):
        raise BenchError(f"{base_url}/v1/models did not answer an OpenAI model list") from None
    if not models:
        raise BenchError(f"the server at {base_url} lists no model; pass --model")
    return models[0]


async def kernel_report(client: httpx.AsyncClient, base_url: str) -> dict[str, dict[str, int]] | None:
    """The server's kernel report {op: {impl: calls}}, or None where it has none."""
    try:
        resp = await client.get(f"{base_url}/v1/kernel_report", timeout=QUERY_TIMEOUT_S)
        data = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("kernel_report"), dict):
        data = data["kernel_report"]
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        return None
    return data


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{.*\})?)\s+(\S+)")


async def prometheus_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """Every `*_total`, `*_sum` and `*_count` sample of GET /metrics (labels kept in the key): the counters and
    histogram totals whose change over a run means something; None where the server has no /metrics."""
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=QUERY_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out = {}
    for line in resp.text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1).split("{")[0].endswith(("_total", "_sum", "_count")):
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


def report_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, int]] | None:
    """Kernel-report calls made during the run (after − before), ops that ran only."""
    if before is None or after is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for op, impls in after.items():
        for impl, n in impls.items():
            d = n - before.get(op, {}).get(impl, 0)
            if d:
                out.setdefault(op, {})[impl] = d
    return out


def spec_decode_stats(delta: dict[str, float]) -> dict[str, float]:
    """vLLM's acceptance figures from the spec-decode counter deltas (any metric prefix)."""
    def total(suffix: str) -> float:
        return sum(v for k, v in delta.items() if k.split("{")[0].endswith(suffix))

    drafts, drafted = total("spec_decode_num_drafts_total"), total("spec_decode_num_draft_tokens_total")
    accepted = total("spec_decode_num_accepted_tokens_total")
    if not drafted or not drafts:
        return {}
    return {"spec_decode_acceptance_rate": 100.0 * accepted / drafted,
            "spec_decode_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(drafted),
            "spec_decode_accepted_tokens": int(accepted)}


# ---- the run -----------------------------------------------------------------------------------------
async def benchmark(opts: ServeOptions, requests: list[SampleRequest], tokenizer=None) -> dict[str, Any]:
    from nvllm.logger import console

    base = opts.base_url.rstrip("/")
    url = base + "/" + opts.endpoint.lstrip("/")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=opts.max_concurrency)
    timeout = httpx.Timeout(opts.timeout_s, connect=10.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        try:
            model = opts.model or await first_model(client, base)
            console().print(f"[dim]test request to {url} (model {model!r})[/]", highlight=False)
            first = requests[0]
            probe = await send_request(client, url, build_payload(first, model, opts), first.prompt_len,
                                       opts.chat, tokenizer)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise BenchError(f"cannot reach the server at {base} ({e or type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise BenchError(f"the server at {base} did not answer properly ({type(e).__name__}: {e})") from None
        if not probe.success:
            if probe.error.startswith(("ConnectError", "ConnectTimeout")):
                raise BenchError(f"cannot reach the server at {base} ({probe.error})")
            raise BenchError(f"the test request to {url} failed: {probe.error}")
        out = console()
        out.print(f"[bold]bench serve[/] {url} model {model!r}: {len(requests)} requests, "
                  f"{describe(opts.request_rate, opts.burstiness)}, max concurrency "
                  f"{opts.max_concurrency or 'unlimited'}", highlight=False)
        report_before, counters_before = await kernel_report(client, base), await prometheus_counters(client, base)
        results, duration = await _run(client, url, model, opts, requests, tokenizer)
        report_after, counters_after = await kernel_report(client, base), await prometheus_counters(client, base)

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "mode": "serve",
        "backend": "openai-chat" if opts.chat else "openai", "base_url": base, "endpoint": opts.endpoint,
        "model_id": model, "tokenizer_id": getattr(tokenizer, "name_or_path", None),
        "num_prompts": len(requests),
        "request_rate": opts.request_rate,  # inf (all at once) is saved as "inf" (report.save_result)
        "burstiness": opts.burstiness, "max_concurrency": opts.max_concurrency,
        "goodput_slos_ms": opts.goodput or None, "lora_modules": opts.lora_modules or None,
    }
    result.update(calculate_metrics(results, duration, opts.percentiles, opts.goodput))
    result["kernel_report"] = report_delta(report_before, report_after)
    if counters_before is not None and counters_after is not None:
        delta = counter_delta(counters_before, counters_after)
        result["server_metrics_delta"] = delta
        result.update(spec_decode_stats(delta))
        result.update(disagg_stats(delta, result["duration"]))
    return result


async def _run(client, url, model, opts, requests, tokenizer) -> tuple[list[RequestResult], float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from nvllm.logger import console

    offsets = arrival_offsets(len(requests), opts.request_rate, opts.burstiness, opts.seed)
    semaphore = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    failed = 0
    with Progress(TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                  console=console(), disable=not opts.progress) as bar:
        task = bar.add_task("bench", total=len(requests), failed=0)

        rng = random.Random(opts.seed)  # as vLLM's benchmark: a seeded random adapter per request
        names = [rng.choice(opts.lora_modules) if opts.lora_modules else model for _ in requests]

        async def one(req: SampleRequest, name: str) -> RequestResult:
            nonlocal failed
            payload = build_payload(req, name, opts)
            if semaphore is None:
                res = await send_request(client, url, payload, req.prompt_len, opts.chat, tokenizer)
            else:
                async with semaphore:
                    res = await send_request(client, url, payload, req.prompt_len, opts.chat, tokenizer)
            failed += not res.success
            bar.update(task, advance=1, failed=failed)
            return res

        start = time.perf_counter()
        tasks = []
        for req, at, name in zip(requests, offsets, names):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req, name)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def run_serve_benchmark(opts: ServeOptions, requests: list[SampleRequest], tokenizer=None) -> dict[str, Any]:
    if not requests:
        raise BenchError("no requests to send")
    return asyncio.run(benchmark(opts, requests, tokenizer))
