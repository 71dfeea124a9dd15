"""Starting the real `nvllm serve` as a subprocess for the tests that talk to it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TAKEN = "Address already in use"
"""What uvicorn logs when another process bound the port between ``free_port`` and the server's own bind (tests
run in parallel): the start is then retried on another port."""


def start_server(args: list[str], log_path: Path, timeout: float = 120, attempts: int = 3, command: str = "serve"
                 ) -> tuple[subprocess.Popen, str]:
    """`nvllm COMMAND ARGS` (``serve``: the demo model unless ARGS say otherwise; or ``router``) on a free port;
    waits for /health. Returns the process and the base URL; a server that exits or never becomes healthy fails the
    test (one whose port was taken meanwhile is started again on another, up to ``attempts`` times)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nvllm.cli", command, "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            if attempts > 1 and PORT_TAKEN in log_path.read_text():
                return start_server(args, log_path, timeout, attempts - 1, command)
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not become healthy:\n{log_path.read_text()}")
        time.sleep(0.25)


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
