"""Disaggregation's commands on their own: flag mistakes (one line, exit 2), the launcher's worker flags, a worker
that waits for its group and still stops on a signal, `nvllm serve --disaggregate 1P1D` started and stopped as one,
and the router's bookkeeping (response owners, a worker the socket layer refuses)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.server_utils import free_port, spawn, start_server

KEY = "sk-disagg"
MODEL = "stories260K"
COMMON = ["--device", "cpu", "--max-model-len", "256", "--log-stats-interval", "0", "--uvicorn-log-level", "warning",
          "--api-key", KEY, "--max-request-bytes", "65536"]
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- user mistakes: one line, exit 2 ---------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["serve", "--role", "decode"], "--kv-rank, --kv-world-size and --kv-master"),
    (["serve", "--role", "sideways"], "unknown role"),
    (["serve", "--role", "prefill", "--kv-rank", "2", "--kv-world-size", "2", "--kv-master", "h:1"], "--kv-rank"),
    (["serve", "--role", "prefill", "--kv-rank", "0", "--kv-world-size", "2", "--kv-master", "nohost"], "HOST:PORT"),
    (["serve", "--kv-rank", "0"], "need --role prefill or decode"),
    (["serve", "--kv-store-external"], "need --role prefill or decode"),
    (["serve", "--fd", "-1"], "--fd must be a file descriptor"),
    (["serve", "--max-prefill-length", "10"], "--max-prefill-length needs --role prefill"),
    (["serve", "--disaggregate", "1X1D"], "xPyD"),
    (["serve", "--disaggregate", "1P1D", "--role", "prefill"], "launches the workers itself"),
    (["serve", "--disaggregate", "1P1D", "--kv-store-external"], "launches the workers itself"),
    (["serve", "--prefill-max-num-seqs", "4"], "goes with --disaggregate"),
    (["router"], "--prefill and --decode"),
    (["router", "--prefill", "http://a:1", "--decode", "b:2"], "not an http(s):// URL"),
    (["router", "--mixed", "http://127.0.0.1:99999,http://a:1"], "has port 99999; ports are 1-65535"),
    (["router", "--mixed", "http://a:port"], "is not a valid URL"),
    (["router", "--mixed", "http://:80"], "names no host"),
    (["router", "--mixed", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"], "not both"),
    (["router", "--mixed", "http://a:1", "--fd", "-1"], "--fd must be a file descriptor"),
    (["router", "--mixed", "http://a:1", "--shutdown-timeout", "-1"], "--shutdown-timeout must be non-negative"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must be non-negative"),   # serve and router alike
    (["serve", "--chat-template", "{% if %}"], "--chat-template does not compile (line 1)"),  # then 400 on every chat
    (["router", "--mixed", "http://a:1", "--max-request-bytes", "0"], "max_request_bytes must be at least 1"),
    (["router", "--mixed", "http://a:1", "--api-key", ""], "api_key must not be empty"),
    (["router", "--mixed", "http://a:1", "--poll-interval", "nan"], "--poll-interval must be a positive number"),
    (["router", "--mixed", "http://a:1", "--log-interval", "inf"], "--log-interval must be a non-negative number"),
    (["serve", "--role", "prefill", "--kv-rank", "0", "--kv-world-size", "2", "--kv-master", "h:1",
      "--kv-transfer-timeout", "inf"], "--kv-transfer-timeout must be a positive number of seconds, got inf"),
    (["serve", "--kv-handle-timeout", "nan"], "--kv-handle-timeout must be a positive number of seconds, got nan"),
])
def test_cli_mistakes(args, message):
    from typer.testing import CliRunner

    from nvllm.cli import app

    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 2 and message in res.output, res.output


def test_a_taken_store_port_is_one_line_before_the_model_loads(monkeypatch):
    """Rank 0 serves the KV transfer group's store on --kv-master's port: another process holding it is told at
    once, not after the model has loaded."""
    import socket

    from typer.testing import CliRunner

    from nvllm.cli import app
    from nvllm.engine.llm_engine import LLMEngine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LLMEngine, "__init__", no_load)
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", "--role", "prefill", "--kv-rank", "0", "--kv-world-size", "2",
                                       "--kv-master", f"127.0.0.1:{port}", "--port", "0", "--device", "cpu"],
                                 env={"COLUMNS": "200"})
    assert res.exit_code == 2 and f"port {port} is taken" in res.output, res.output


def test_worker_flags_rebuild_the_engine_config():
    """The launcher's worker flags: nothing for the defaults (an empty --hf-overrides included), and flags that the
    CLI parses back into the same config."""
    from nvllm.config import EngineConfig
    from nvllm.disagg.launcher import engine_cli_args

    assert "--hf-overrides" not in engine_cli_args(EngineConfig(device="cpu"))
    config = EngineConfig(device="cpu", max_model_len=128, enable_prefix_caching=False,
                          hf_overrides={"max_position_embeddings": 200})
    args = engine_cli_args(config)
    assert "--no-enable-prefix-caching" in args and args[args.index("--max-model-len") + 1] == "128", args
    again = EngineConfig(device="cpu", hf_overrides=args[args.index("--hf-overrides") + 1])
    assert again.hf_overrides == {"max_position_embeddings": 200}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_worker_waiting_for_its_group_stops_on_a_signal(tmp_path, sig, monkeypatch):
    """A prefill worker whose decode worker never comes waits in the group's rendezvous, says so, and still stops on
    SIGTERM or Ctrl-C (the wait blocks in the store's C++ code, where signal handlers cannot run)."""
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # a worker that does not stop shows where it is (SIGABRT below)
    log = tmp_path / "alone.log"
    proc, _ = spawn("serve", [*COMMON, "--role", "prefill", "--kv-rank", "0", "--kv-world-size", "2",
                              "--kv-master", f"127.0.0.1:{free_port()}"], log)
    try:
        deadline = time.monotonic() + 120
        while "joining the KV transfer group" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(sig)
        try:
            code = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            pytest.fail(f"no exit 15 s after {sig.name}:\n{log.read_text()}")
        assert code in (0, 128 + sig), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- one command: --disaggregate ------------------------------------------------------------------------------
def test_disaggregate_1p1d_launches_and_stops_as_one(tmp_path):
    log = tmp_path / "launcher.log"
    proc, url = start_server(["--disaggregate", "1P1D", "--prefill-max-num-seqs", "4", "--shutdown-timeout", "120",
                              *COMMON], log)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 8
    workers = httpx.get(f"{url}/router/workers", headers=AUTH).json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    pids = [w["info"]["pid"] for w in workers]
    # SIGTERM with a stream in flight (7 s here when idle): it runs to its end within --shutdown-timeout, past the
    # 5 s the router once gave it
    stream = iter(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=240, n=16, temperature=1.0,
                                       stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    proc.send_signal(signal.SIGTERM)
    finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"] * 16, finishes
    assert proc.wait(60) == 0, log.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    text = log.read_text()
    assert "[prefill-0]" in text and "--max-num-seqs 4" in text, text
    # the workers got their sockets bound and the group's store served by the launcher: no port picked, then bound
    assert text.count("serve --fd ") == 2 and text.count("--kv-store-external") == 2, text


def test_disaggregate_streams_past_the_shutdown_timeout_end_properly(tmp_path):
    """SIGTERM with streams longer than --shutdown-timeout: once it has passed the workers abort them, so each
    stream still ends with its last chunk (finish_reason "abort") and [DONE] — the router cut them off mid-way."""
    log = tmp_path / "launcher.log"
    proc, url = start_server(["--disaggregate", "1P1D", "--shutdown-timeout", "1", *COMMON], log)
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "n": 16,
                            "temperature": 1.0, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")]
    assert sorted(f for f in finishes if f) == ["abort"] * 16, rest[-6:]
    assert "data: [DONE]" in rest, rest[-6:]
    assert proc.wait(60) == 0, log.read_text()
    assert "no decode worker is left" not in log.read_text()


# ---- the router's bookkeeping ---------------------------------------------------------------------------------
def test_response_owners_keep_the_latest_ids():
    from nvllm.disagg.response_owners import ResponseOwners

    owners = ResponseOwners(size=2)
    owners.note_body(b'{"id": "resp_a", "object": "response"}', "http://a")
    assert not owners.note_event('event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n',
                                 "http://b")
    assert owners.note_event('event: response.created\ndata: {"type": "response.created", "response": {"id": '
                             '"resp_b"}}\n\n', "http://b")
    owners.note_body(b"not json", "http://c")
    assert (owners.owner("resp_a"), owners.owner("resp_b"), owners.owner(None)) == ("http://a", "http://b", None)
    owners.note("resp_c", "http://c")
    assert owners.owner("resp_a") is None and owners.owner("resp_c") == "http://c"   # the oldest went


def test_a_worker_the_socket_layer_refuses_is_marked_down_and_polling_goes_on():
    """A URL the socket layer refuses past httpx (port 99999: OverflowError) marks that worker down; the other
    worker's poll still runs, and so does the next round (the router's poll loop never dies)."""
    from nvllm.disagg.worker_pool import WorkerPool

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.port == 99999:
            raise OverflowError("connect(): port must be 0-65535")
        return httpx.Response(200)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            pool = WorkerPool([], [], ["http://127.0.0.1:99999", "http://127.0.0.1:8001"], client)
            for _ in range(2):
                await pool.poll_all()
            return [w.up for w in pool.workers]

    assert asyncio.run(main()) == [False, True]
    assert seen.count("http://127.0.0.1:8001/health") == 2
