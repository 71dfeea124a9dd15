"""`nvllm serve` when clients leave: a stream closed early, a timed-out call, a call of many prompts abandoned while
queued, a body never finished. Their requests are aborted and their blocks freed (checked on /metrics); nothing is
logged as an error. The server schedules asynchronously, as it does by default on a GPU."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from tests.server_utils import http_client, start_server, stop_server, wait_idle

KEY = "sk-test-key"
MODEL = "stories260K"
PROMPT = "Once upon a time"
LOG: dict = {}  # the module server's log file


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = LOG["path"] = tmp_path_factory.mktemp("serve_clients_gone") / "server.log"
    proc, base = start_server(["--api-key", KEY, "--async-scheduling", "--max-model-len", "256", "--device", "cpu",
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], log_path)
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def http(server):
    with http_client(server, KEY) as c:
        yield c


def test_disconnected_clients_free_their_blocks(server, http):
    before = wait_idle(http)

    async def leave_early(ac: openai.AsyncOpenAI, i: int) -> None:
        stream = await ac.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=200, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break  # one chunk, then hang up
        await stream.close()

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60) as ac:
            await asyncio.gather(*(leave_early(ac, i) for i in range(20)))

    asyncio.run(main())
    after = wait_idle(http)  # the block pool is back to full and nothing runs
    aborted = after.get("nvllm:request_success_total[abort]", 0) - before.get("nvllm:request_success_total[abort]", 0)
    assert aborted == 20
    assert after["nvllm:generation_tokens_total"] - before["nvllm:generation_tokens_total"] < 20 * 200


def test_non_streaming_client_timeout_aborts(server, http):
    before = wait_idle(http)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30.0, read=0.5),
                   json={"prompt": PROMPT, "max_tokens": 230, "ignore_eos": True, "n": 8, "temperature": 1.0})
    after = wait_idle(http)
    assert after["nvllm:request_success_total[abort]"] - before.get("nvllm:request_success_total[abort]", 0) == 8


def test_client_gone_while_its_many_prompts_are_queued(server, http):
    """A call of hundreds of prompts is queued in one trip to the engine, and a client that leaves meanwhile or
    after aborts them all (one trip per prompt took as long as generating them, unwatched)."""
    n, max_tokens = 600, 40
    before = wait_idle(http)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30.0, read=0.5),
                   json={"prompt": [[5, 6, 7]] * n, "max_tokens": max_tokens, "ignore_eos": True})
    after = wait_idle(http)
    assert after["nvllm:request_success_total[abort]"] - before.get("nvllm:request_success_total[abort]", 0) == n
    assert after["nvllm:generation_tokens_total"] - before["nvllm:generation_tokens_total"] < n * max_tokens / 4


def test_a_client_gone_while_sending_its_body_is_no_error(server, http):
    host, port = server.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    assert http.get("/health").status_code == 200
    wait_idle(http)
    log = LOG["path"].read_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
