"""Starting the real `nvllm serve` as a subprocess for the tests that talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A port free a moment ago, for what must not be listening (a dead URL) or binds it at once itself. A server
    the test starts gets its socket bound instead (``spawn``), as tests run in parallel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(command: str, args: list[str], log_path: Path, new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """`nvllm COMMAND ARGS` on a socket bound here on a free port and handed over (``--fd``): no other process can
    take the port between its choice and the server's start. ``new_session``: its own process group (the test may
    signal the whole group, as a terminal or a service manager does). Returns the process and the base URL."""
    with socket.socket() as sock, open(log_path, "w") as log:
        sock.bind(("127.0.0.1", 0))
        cmd = [sys.executable, "-m", "nvllm.cli", command, "--fd", str(sock.fileno()), *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"},
                                pass_fds=(sock.fileno(),), start_new_session=new_session)
        return proc, f"http://127.0.0.1:{sock.getsockname()[1]}"


def start_server(args: list[str], log_path: Path, timeout: float = 120, command: str = "serve", verify=None,
                 new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """`nvllm COMMAND ARGS` (``serve``: the demo model unless ARGS say otherwise; or ``router``), ``spawn``ed;
    waits for /health. ``verify``: an SSL context trusting the server's certificate, for one serving HTTPS. Returns
    the process and the base URL; a server that exits or never becomes healthy fails the test."""
    proc, base = spawn(command, args, log_path, new_session)
    if verify is not None:
        base = base.replace("http://", "https://")
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=2, verify=verify or True).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not become healthy:\n{log_path.read_text()}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, and SIGKILL if the server has not exited within ``timeout`` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def assert_keeps_idle_connection(base: str) -> None:
    """httpx (so the openai client) keeps an idle connection 5 s. A server must keep it longer, or a client can
    send on a connection the server is closing at that moment, and a request with no retries fails."""
    conn = HTTPConnection(base.removeprefix("http://"), timeout=10)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        sock = conn.sock
        time.sleep(5.5)  # past httpx's keepalive_expiry, and past uvicorn's default keep-alive
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and conn.sock is sock  # the same connection answered
    finally:
        conn.close()


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics parsed with prometheus-client's parser: {sample name (+ finished_reason label): value}."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            reason = s.labels.get("finished_reason")
            out[f"{s.name}[{reason}]" if reason else s.name] = s.value
    return out


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if (m["nvllm:num_requests_running"] == 0 and m["nvllm:num_requests_waiting"] == 0
                and m["nvllm:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"engine did not go idle: {m}"
        time.sleep(0.05)


def openai_client(base: str, key: str) -> openai.OpenAI:
    """The official client on a server the test started (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def http_client(base: str, key: str) -> httpx.Client:
    """httpx on that server, with its API key, for what the official client will not send."""
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
