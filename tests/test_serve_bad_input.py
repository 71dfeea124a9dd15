"""`nvllm serve` under bad input: every malformed or out-of-range request is one 4xx OpenAI error JSON (naming the
field where there is one) and the server keeps serving; the official `openai` client sees typed errors."""

from __future__ import annotations

import openai
import pytest

from tests.server_utils import http_client, openai_client, start_server, stop_server

KEY = "sk-test-key"
MODEL = "stories260K"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 65536
LOG: dict = {}  # the module server's log file


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = LOG["path"] = tmp_path_factory.mktemp("serve_bad_input") / "server.log"
    proc, base = start_server(["--api-key", KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                               "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning"], log_path)
    yield base
    stop_server(proc)
    assert "Traceback" not in log_path.read_text()


@pytest.fixture(scope="module")
def http(server):
    with http_client(server, KEY) as c:
        yield c


# ---- bad input ------------------------------------------------------------------------------------------------
LONG_PROMPT = "the cat sat on the mat " * 80  # far over max_model_len tokens
BAD_REQUESTS = [
    # (what, path, body (dict, or raw bytes), headers override, status)
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi", ', None, 400),
    ("body not an object", "/v1/completions", b"[1, 2]", None, 400),
    ("JSON nested too deeply", "/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     None, 400),
    ("a lone surrogate", "/v1/completions", b'{"prompt": "hi \\ud800"}', None, 400),
    ("a lone surrogate (chat)", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     None, 400),
    ("a lone surrogate (tokenize)", "/tokenize", b'{"prompt": "\\uD83D x"}', None, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, None, 404),
    ("unknown model (chat)", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     None, 404),
    ("prompt over max_model_len", "/v1/completions", {"prompt": LONG_PROMPT}, None, 400),
    ("prompt + max_tokens over max_model_len", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN},
     None, 400),
    ("chat over max_model_len", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]},
     None, 400),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, None, 400),
    ("max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None, 400),
    ("max_tokens not a number", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, None, 400),
    ("n 0", "/v1/completions", {"prompt": "hi", "n": 0}, None, 400),
    ("temperature negative", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, None, 400),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, None, 400),
    ("top_p above 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
     None, 400),
    ("top_k -5", "/v1/completions", {"prompt": "hi", "top_k": -5}, None, 400),
    ("min_p 2", "/v1/completions", {"prompt": "hi", "min_p": 2}, None, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, None, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, None, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, None, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400),
    ("a text part without text", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, None, 400),
    ("presence_penalty above 2", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, None, 400),
    ("frequency_penalty below -2", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, None, 400),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, None, 400),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, None, 400),
    ("logit_bias id outside the vocabulary", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 5}}, None,
     400),
    ("seed out of range", "/v1/completions", {"prompt": "hi", "seed": 2**70}, None, 400),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, None, 400),
    ("stream_options without stream (chat)", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}, "stream": False},
     None, 400),
    ("oversized body", "/v1/completions", {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}, None, 413),
    ("wrong API key", "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401),
    ("no API key", "/v1/models", None, {"Authorization": ""}, 401),
    ("unknown route", "/v1/nothing", {"prompt": "hi"}, None, 404),
    ("bad detokenize ids", "/detokenize", {"tokens": [-1]}, None, 400),
    ("an integer of 5000 digits", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None,
     400),
    ("repetition_penalty below float32's range", "/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-40},
     None, 400),
    ("length_penalty not a number", "/v1/completions",
     b'{"prompt": "hi", "use_beam_search": true, "n": 2, "length_penalty": NaN}', None, 400),
    ("Responses text.format not an object", "/v1/responses", {"input": "hi", "text": {"format": "json"}}, None,
     400),
    ("a chat template in the request", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages[0].content }}"}, None, 400),
    ("tool parameters with a $defs not an object", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": 5}}}]},
     None, 400),
]


def test_fields_the_server_lacks_are_named_in_its_log(http):
    """A request field this server does not use is ignored, as vLLM ignores it, and named in a warning (vLLM logs
    them too): a client relying on one learns it from the log."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "vllm_xargs": {"a": 1},
                                           "zz_unknown_field": True, "spaces_between_special_tokens": False})
    assert r.status_code == 200
    assert "the request's fields vllm_xargs, zz_unknown_field are not used by this server" in LOG["path"].read_text()


def test_a_bad_sampling_field_is_named_as_the_error_param(http):
    for extra, param in (({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"stream_options": {"include_usage": True}}, "stream_options")):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("what,path,body,headers,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_answers_4xx(http, what, path, body, headers, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    if body is None:
        r = http.get(path, headers=headers)
    else:
        r = http.post(path, headers={"Content-Type": "application/json", **(headers or {})}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # and the server keeps serving
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_a_surrogate_pair_is_one_character(http):
    r = http.post("/v1/completions", content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2, "echo": true}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi \U0001F600")


def test_seeds_at_both_ends_of_int64_are_accepted(http):
    """vLLM's range for seed is int64's: -2**63 and 2**63 - 1 both sample (one past either end is a 400)."""
    for seed, status in ((-2**63, 200), (2**63 - 1, 200), (-2**63 - 1, 400)):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "seed": seed})
        assert r.status_code == status, (seed, r.text)


def test_openai_client_sees_typed_errors(server):
    client = openai_client(server, KEY)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=["x"] * 65)
    assert e.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError, match="a text content part needs its text"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_an_unexpected_error_is_a_500_json_on_a_connection_that_stays_open(caplog):
    """A bug behind a route is one 500 in the OpenAI shape, logged, and the client's keep-alive connection still
    serves its next request (Starlette's handler for Exception re-raises, and the server then drops the
    connection: a client that reused it got a reset)."""
    import json
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI

    from nvllm.serve.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)

    def answer(conn, path):  # one HTTP/1.1 exchange on ``conn``: status and JSON body
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            assert chunk, f"connection closed before {path} was answered"
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(body) < length:
            chunk = conn.recv(65536)
            assert chunk, f"connection closed inside {path}'s body"
            body += chunk
        return int(head.split()[1]), json.loads(body)

    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as conn:
            status, body = answer(conn, "/boom")
            assert status == 500
            assert body["error"]["type"] == "server_error" and "RuntimeError: a bug" in body["error"]["message"]
            time.sleep(0.2)  # the server had closed the connection by now
            assert answer(conn, "/ok") == (200, {"ok": True})
        assert "unexpected error serving /boom" in caplog.text
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
