"""`nvllm bench serve`: the client against a small fake OpenAI-compatible streaming server (timings it controls,
failures, bad input), and end to end against the real `nvllm serve` on the demo model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from typer.testing import CliRunner

from nvllm.cli import app
from tests.server_utils import free_port, start_server, stop_server

runner = CliRunner()


def said(res) -> str:
    """The command's output with Rich's line wrapping undone."""
    return " ".join(res.output.split())


SERVE_KEYS = [
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors", "kernel_report",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p90", "p99")]


@pytest.fixture(scope="module")
def tok(demo_dir):
    from nvllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(demo_dir)


# ---- a fake OpenAI-compatible streaming server -----------------------------------------------------------
class FakeState:
    def __init__(self):
        self.reset()

    def reset(self, fail_every=0, fail_mode="http", fail_after=None, usage=True, eos=False):
        self.count, self.served = 0, 0
        self.fail_every, self.fail_mode, self.fail_after = fail_every, fail_mode, fail_after
        self.usage = usage
        self.eos = eos  # the last token is EOS: a step later, a chunk with no text and finish_reason "stop"
        self.inflight = self.peak = 0  # streams open at once, and the most seen
        self.temperatures = []  # each request's, as sent


def _fake_app(state: FakeState):
    app = FastAPI()

    def err(status, message, kind):
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/v1/kernel_report")
    async def kernel_report():
        return {"gemm": {"fake cuBLAS": 10 * state.served}, "attention.decode": {"fake paged": 2 * state.served}}

    @app.get("/metrics")
    async def prom():
        s = state.served
        return PlainTextResponse(
            "# HELP fake:spec_decode_num_drafts_total drafts\n# TYPE fake:spec_decode_num_drafts_total counter\n"
            f"fake:spec_decode_num_drafts_total{{model_name=\"fake-model\"}} {s}\n"
            f"fake:spec_decode_num_draft_tokens_total{{model_name=\"fake-model\"}} {4 * s}\n"
            f"fake:spec_decode_num_accepted_tokens_total{{model_name=\"fake-model\"}} {3 * s}\n"
            f"fake:num_requests_running 0\n")

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if body.get("model") != "fake-model":
            return err(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        state.count += 1
        state.temperatures.append(body.get("temperature"))
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        fail = (state.fail_every and state.count % state.fail_every == 0) or \
               (state.fail_after is not None and state.count > state.fail_after)
        if fail and state.fail_mode == "http":
            return err(500, "injected failure", "InternalServerError")
        assert body["stream"] and body["stream_options"]["include_usage"]

        def chunk(piece, finish=None):
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        async def stream():
            state.inflight += 1
            state.peak = max(state.peak, state.inflight)
            try:
                async for piece in tokens():
                    yield piece
            finally:
                state.inflight -= 1

        async def tokens():
            if chat:  # the role announcement carries no token: TTFT must not stop here
                role = {'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]}
                yield f"data: {json.dumps(role)}\n\n"
            await asyncio.sleep(0.02)
            for i in range(n):
                if i:
                    await asyncio.sleep(0.005)
                if fail and i == 1:
                    yield f"data: {json.dumps({'error': {'message': 'injected stream error', 'code': 500}})}\n\n"
                    return
                if i < n - 1:
                    yield chunk(f" t{i}")
                elif state.eos:
                    yield chunk("", "stop")
                else:
                    yield chunk(f" t{i}", "length")
            state.served += 1
            if state.usage:
                usage = {'prompt_tokens': 7, 'completion_tokens': n, 'total_tokens': 7 + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here, served by uvicorn: no other test can take the port in between
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _bench(url, tmp_path, *extra, name="out.json"):
    out = tmp_path / name
    res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "16",
                              "--output-len", "5", "--request-rate", "200", "--max-concurrency", "4",
                              "--no-progress", "--save-result", str(out), *extra])
    return res, (json.loads(out.read_text()) if out.exists() else None)


def test_a_request_ending_on_eos_counts_its_last_step(fake_server, tmp_path):
    """A stream that ends on EOS ends with a chunk carrying only finish_reason: that chunk is the last token's
    step (as vLLM's benchmark counts it), so E2EL reaches it, ITL has a gap per token after the first, and TPOT
    equals the mean ITL."""
    url, state = fake_server
    state.reset(eos=True)
    res, r = _bench(url, tmp_path)
    assert res.exit_code == 0, res.output
    assert r["output_lens"] == [5] * 12 and r["generated_texts"][0] == " t0 t1 t2 t3"
    assert all(len(itl) == 4 for itl in r["itls"])
    assert r["mean_tpot_ms"] == pytest.approx(r["mean_itl_ms"], rel=1e-6)
    # the four steps after the first token, none lost, whatever the timing on a loaded machine
    assert r["mean_tpot_ms"] == pytest.approx((r["mean_e2el_ms"] - r["mean_ttft_ms"]) / 4, rel=1e-6)
    state.reset()


def test_serve_against_fake_server(fake_server, tmp_path):
    url, state = fake_server
    state.reset()
    res, r = _bench(url, tmp_path, "--goodput", "ttft:5000", "tpot:5000", "--metric-percentiles", "50,90,99")
    assert res.exit_code == 0, res.output
    assert [k for k in SERVE_KEYS if k not in r] == []
    assert (r["completed"], r["failed"], r["model_id"]) == (12, 0, "fake-model")
    # output tokens from the server's usage; input tokens the dataset's count (the fake server's usage says 7), as
    # vLLM's benchmark counts them
    assert r["output_lens"] == [5] * 12 and r["input_lens"] == [16] * 12
    assert r["total_output_tokens"] == 60 and r["total_input_tokens"] == 192
    assert r["mean_ttft_ms"] >= 20.0 and r["mean_tpot_ms"] > 0 and r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert all(len(itl) == 4 for itl in r["itls"]) and r["generated_texts"][0] == " t0 t1 t2 t3 t4"
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: every request good
    assert state.peak <= 4  # --max-concurrency held, as the server saw it
    assert set(state.temperatures) == {0.0}  # greedy unless --temperature, as vLLM's benchmark sends
    # vLLM's figure counts the requests active in a one-second bucket: at least those in flight at once
    assert state.peak <= r["max_concurrent_requests"] <= 12
    assert r["kernel_report"] == {"gemm": {"fake cuBLAS": 120}, "attention.decode": {"fake paged": 24}}
    assert r["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert r["spec_decode_acceptance_length"] == pytest.approx(4.0)
    assert "Successful requests" in said(res) and "kernel report" in said(res)


def test_serve_takes_vllms_bench_flags(fake_server, tmp_path, demo_dir):
    """A `vllm bench serve` command line: --host/--port, --backend openai-chat, --served-model-name with --model
    naming the tokenizer's model, --dataset-name, --random-input-len/--random-output-len, --disable-tqdm."""
    url, state = fake_server
    state.reset()
    host, port = url.removeprefix("http://").split(":")
    out = tmp_path / "vllm.json"
    res = runner.invoke(app, ["bench", "serve", "--host", host, "--port", port, "--backend", "openai-chat",
                              "--model", demo_dir, "--served-model-name", "fake-model", "--dataset-name", "random",
                              "--random-input-len", "16", "--random-output-len", "5", "--num-prompts", "6",
                              "--disable-tqdm", "--save-result", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert (r["backend"], r["completed"], r["model_id"]) == ("openai-chat", 6, "fake-model")
    assert r["output_lens"] == [5] * 6
    for bad, message in ((["--backend", "tgi"], "--backend 'tgi' is not supported"),
                         (["--base-url", url, "--port", port], "give --base-url or --host/--port, not both")):
        res = runner.invoke(app, ["bench", "serve", *bad, "--num-prompts", "1"])
        assert res.exit_code == 2 and message in res.output


def test_prompt_tokens_are_counted_with_the_models_tokenizer_or_a_warning(tmp_path, monkeypatch, demo_dir):
    """--model's tokenizer counts the prompts (a directory, or a Hub id as vLLM's benchmark loads it); a name
    nothing can be loaded from falls back to the demo model's tokenizer, and says so."""
    from huggingface_hub import constants

    from nvllm.bench.cli import _model_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert _model_tokenizer(demo_dir, False).name_or_path == demo_dir
    for name in ("org/not-cached", "my-served-name", None):   # None: no --model (the server's first model runs)
        res = runner.invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", *(["--model", name] if name
                                  else []), "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
                                  "--no-progress"])
        assert "prompt tokens are counted with the demo model's tokenizer; pass --tokenizer" in res.output, name
    with pytest.raises(ValueError, match="cannot load the tokenizer of --model org/not-cached"):
        _model_tokenizer("org/not-cached", True)  # --served-model-name: --model must name the tokenizer's model
    # a Hub id fetches its tokenizer and config files, never the weights (one quick failure without the network,
    # where loading the tokenizer by its id retried each file for about a minute)
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: asked.append(kw) or demo_dir)
    assert _model_tokenizer("org/model", False).name_or_path == demo_dir
    assert asked[0]["repo_id"] == "org/model" and "*.safetensors" not in asked[0]["allow_patterns"]


def test_serve_chat_endpoint_counts_content_chunks(fake_server, tmp_path, tok):
    url, state = fake_server
    state.reset(usage=False)  # a server that sends no usage: the client's tokenizer counts the output
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                             for i in range(3)))
    res, r = _bench(url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset", "gsm8k",
                    "--dataset-path", str(gsm))
    assert res.exit_code == 0, res.output
    assert r["backend"] == "openai-chat" and r["completed"] == 12
    assert min(r["ttfts"]) >= 0.02  # the role-only chunk at t=0 is not the first token
    assert all(len(itl) == 4 for itl in r["itls"])
    assert r["output_lens"] == [len(tok.encode(" t0 t1 t2 t3 t4", add_special_tokens=False))] * 12
    assert min(r["input_lens"]) > 20  # the client's count of the rendered chat prompt


@pytest.mark.parametrize("mode", ["http", "stream"])
def test_serve_reports_failed_requests(fake_server, tmp_path, mode):
    url, state = fake_server
    state.reset(fail_every=3, fail_mode=mode)  # the test request is #1; #3, #6, #9, #12 of the run fail
    res, r = _bench(url, tmp_path)
    assert res.exit_code == 0, res.output
    assert (r["completed"], r["failed"]) == (8, 4)
    msg = "HTTP 500: injected failure" if mode == "http" else "error event: injected stream error"
    assert sum(e == msg for e in r["errors"]) == 4
    assert r["output_lens"].count(0) == 4 and r["total_output_tokens"] == 40
    assert "4 of 12 requests failed" in said(res) and msg in said(res)


def test_serve_exits_nonzero_when_all_requests_fail(fake_server, tmp_path):
    url, state = fake_server
    state.reset(fail_after=1)
    res, r = _bench(url, tmp_path)
    assert res.exit_code == 1 and "all 12 requests failed" in said(res)
    assert r["completed"] == 0 and r["mean_ttft_ms"] is None and r["request_throughput"] == 0.0


def test_serve_bad_input(fake_server, tmp_path, monkeypatch):
    import socket

    from nvllm.bench import serve as bench_serve

    url, state = fake_server
    monkeypatch.setattr(bench_serve, "QUERY_TIMEOUT_S", 0.5)
    with socket.socket() as silent:  # accepts connections (its backlog) and never answers: no hang
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        res, _ = _bench(f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path)
    assert res.exit_code == 2 and "did not answer properly (ReadTimeout" in said(res), said(res)
    state.reset()
    res, r = _bench(url, tmp_path, "--model", "no-such-model")
    assert res.exit_code == 2 and r is None
    assert "HTTP 404" in said(res) and "does not exist" in said(res)
    res, _ = _bench(f"http://127.0.0.1:{free_port()}", tmp_path)
    assert res.exit_code == 2 and "cannot reach the server" in said(res)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    res, _ = _bench(url, tmp_path, "--dataset", "jsonl", "--dataset-path", str(bad))
    assert res.exit_code == 2 and "bad.jsonl:1: not valid JSON" in said(res)
    res, _ = _bench(url, tmp_path, "--goodput", "ttft:200", "latency:3")
    assert res.exit_code == 2 and "unknown" in said(res)
    # checked before the server is asked (they were tracebacks from the connection, or the server's own 400)
    for base, args, message in (("http://127.0.0.1:70000", [], "'http://127.0.0.1:70000' has port 70000; ports are "
                                                            "1-65535"),
                                ("http://[::1", [], "--base-url: 'http://[::1' is not a valid URL"),
                                (url, ["--temperature", "nan"], "--temperature must be a finite number of at least 0")):
        res, _ = _bench(base, tmp_path, *args)
        assert res.exit_code == 2 and message in said(res), said(res)


def test_vllms_host_flag_takes_an_ipv6_address():
    from nvllm.bench.cli import _server

    assert _server(None, "::1", 9000, None, "openai") == ("http://[::1]:9000", "/v1/completions")
    assert _server(None, "[::1]", None, None, "openai-chat") == ("http://[::1]:8000", "/v1/chat/completions")



# ---- end to end against the real `nvllm serve` (demo model, subprocess) ------------------------------------
@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    key = "bench-key"
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    proc, base = start_server(["--api-key", key, "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning", "--shutdown-timeout", "5"], log_path)
    yield base, key
    stop_server(proc)


def test_serve_against_real_nvllm_server(real_server, tmp_path):
    url, key = real_server
    res, r = _bench(url, tmp_path, "--api-key", key, "--ignore-eos", "--temperature", "0", "--goodput", "ttft:60000",
                    "--metric-percentiles", "50,90,99")
    assert res.exit_code == 0, res.output
    assert [k for k in SERVE_KEYS if k not in r] == [] and "server_metrics_delta" in r
    assert (r["completed"], r["failed"], r["model_id"]) == (12, 0, "stories260K")
    assert r["output_lens"] == [5] * 12 and r["input_lens"] == [16] * 12  # --input-len
    assert all(r[f"{s}_{m}_ms"] > 0 for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p99"))
    assert all(len(itl) == 4 for itl in r["itls"])  # one chunk per engine step, one token each
    assert r["kernel_report"]["gemm"] and r["kernel_report"]["attention.decode"]
    gen = [v for k, v in r["server_metrics_delta"].items() if k.startswith("nvllm:generation_tokens_total")]
    assert gen == [60.0]  # the server counted the same tokens the client did
    res, _ = _bench(url, tmp_path, "--api-key", key, "--model", "no-such-model")
    assert res.exit_code == 2 and "HTTP 404" in said(res)
    res, _ = _bench(url, tmp_path)  # no API key: the server's 401 ends the run before it starts
    assert res.exit_code == 2 and "HTTP 401" in said(res)


def test_serve_refuses_a_non_finite_goodput_before_running(fake_server, tmp_path):
    url, state = fake_server
    state.reset()
    for slo in ("ttft:nan", "e2el:1e999"):
        res, r = _bench(url, tmp_path, "--goodput", slo)
        assert res.exit_code == 2 and r is None and state.count == 0, said(res)
        assert said(res) == f"error: goodput SLO '{slo}' must be a positive finite number of milliseconds"
