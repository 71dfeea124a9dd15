"""`nvllm serve` as a process: an inherited socket (--fd), the priority policy end to end, SIGHUP."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.server_utils import start_server

MODEL = "stories260K"
PROMPT = "Once upon a time"


def test_fd_serves_an_inherited_socket_and_refuses_anything_else(tmp_path):
    """--fd: the server takes over a socket its launcher bound (no bind of its own, so its port cannot be taken in
    between); a file, a UDP socket or an unbound socket is one clear error, exit 2."""
    import os
    import socket

    from typer.testing import CliRunner

    from nvllm.cli import app
    from nvllm.config import ConfigError
    from nvllm.serve.sockets import adopt_socket, bind_socket, listen_socket

    held = bind_socket("127.0.0.1", 0)
    held.listen()  # now no other socket can bind its port: a bind of --host/--port would fail
    port = held.getsockname()[1]
    with listen_socket("127.0.0.1", port, os.dup(held.fileno())) as sock:
        assert sock.getsockname()[:2] == ("127.0.0.1", port)
    held.close()

    udp, unbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket()
    udp.bind(("127.0.0.1", 0))
    with udp, unbound:
        for s, message in ((udp, "not a TCP socket"), (unbound, "not bound to a port")):
            with pytest.raises(ConfigError, match=message):
                adopt_socket(s.fileno())
            assert s.fileno() >= 0  # refused, and still the caller's
    with open(tmp_path / "not-a-socket", "w") as f:
        fd = f.fileno()
        res = CliRunner().invoke(app, ["serve", "--fd", str(fd)], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and f"--fd {fd} is not an open socket" in res.output, res.output


def test_priority_scheduling_serves_request_priorities(tmp_path):
    """--scheduling-policy priority: completions, chat, beam search and responses take a request's priority (any
    integer)."""
    from tests.server_utils import stop_server

    proc, base = start_server(["--scheduling-policy", "priority", "--max-num-seqs", "2", "--device", "cpu",
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], tmp_path / "log")
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 3}),
                               ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2,
                                                    "max_tokens": 3}),
                               ("/v1/responses", {"input": "Hi", "max_output_tokens": 3})):
                r = http.post(path, json={"model": "stories260K", "priority": -4, **body})
                assert r.status_code == 200, r.text
    finally:
        stop_server(proc)


def test_sighup_shuts_the_server_down_as_sigterm_does(tmp_path):
    """The terminal that started `nvllm serve` closed (SIGHUP): the same graceful shutdown as SIGTERM, exit 0."""
    proc, base = start_server(["--device", "cpu", "--log-stats-interval", "0"], tmp_path / "log")
    try:
        assert httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                          timeout=60).status_code == 200
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 0, (tmp_path / "log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "log").read_text()
    assert "server stopped" in log and "Traceback" not in log, log
