"""`nvllm serve` end to end: the real server started once as a subprocess on a free port (the demo model),
driven with the official `openai` client and raw httpx for what the client will not send."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import assert_keeps_idle_connection, start_server

KEY = "sk-test-key"
MODEL = "stories260K"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 65536
PROMPT = "Once upon a time"


LOG: dict = {}  # the module server's log file


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server for the whole module; on teardown SIGTERM must shut it down cleanly (exit status 0). It
    schedules asynchronously, as it does by default on a GPU."""
    log_path = LOG["path"] = tmp_path_factory.mktemp("serve") / "server.log"
    proc, base = start_server(["--api-key", KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES), "--async-scheduling",
                               "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning", "--shutdown-timeout", "1"], log_path)
    yield base
    _shutdown_with_a_stream_in_flight(proc, base, log_path)


def _shutdown_with_a_stream_in_flight(proc: subprocess.Popen, base: str, log_path) -> None:
    """SIGTERM while a stream runs: the stream still ends properly (every choice finished, then [DONE] — the
    client would raise on a cut connection) and the server exits with status 0."""
    result: dict = {}

    def stream_long() -> None:
        try:
            c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
            finishes = {}
            for ch in c.completions.create(model=MODEL, prompt=PROMPT, n=16, max_tokens=MAX_MODEL_LEN - 16,
                                           temperature=1.0, stream=True, extra_body={"ignore_eos": True}):
                result["started"] = True
                finishes.update({x.index: x.finish_reason for x in ch.choices if x.finish_reason})
            result["finishes"] = finishes
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=stream_long)
    thread.start()
    deadline = time.monotonic() + 30
    while "started" not in result and "error" not in result and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    thread.join(60)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"server ignored SIGTERM:\n{log_path.read_text()}")
    assert "error" not in result, result
    assert len(result["finishes"]) == 16 and set(result["finishes"].values()) <= {"length", "abort"}, result
    assert rc == 0, log_path.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


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


# ---- the happy paths ---------------------------------------------------------------------------------------
def test_models_health_kernel_report(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = http.post("/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 1})  # "" is the base, as null
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    assert http.get("/health").status_code == 200
    report = http.get("/v1/kernel_report").json()
    assert "gemm" in report and all(isinstance(v, int) for impls in report.values() for v in impls.values())


def test_an_idle_connection_outlives_the_clients_keepalive(server):
    assert_keeps_idle_connection(server)


def test_completion_usage_and_stream(client, http):
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    c = full.choices[0]
    assert c.finish_reason == "length" and c.text
    u = full.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 12, n_prompt + 12)
    assert u.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    content = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in content) == c.text
    assert len(content) == 12  # one chunk per engine step
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # a prompt longer than a block, twice: the second time its first block comes from the prefix cache
    long_prompt = PROMPT + " there was a little girl who liked to play in the park with her friends"
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 > first.usage.prompt_tokens_details.cached_tokens


def test_token_id_prompts_and_tokenizer_endpoints(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids[1:]}).json()["prompt"] == PROMPT
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    both = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in both.choices] == [by_text.choices[0].text] * 2
    assert both.usage.prompt_tokens == 2 * len(ids)


def test_add_special_tokens_and_tokenize_agree_with_the_request(client, http):
    """vLLM's add_special_tokens on completions and chat: without it no BOS; /tokenize with a conversation's fields
    (continue_final_message included) counts what chat sends."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                      extra_body={"add_special_tokens": False})
    assert plain.usage.prompt_tokens == len(ids) - 1
    assert http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == ids[1:]
    messages = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
    for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
        for body in ({"add_generation_prompt": False, "continue_final_message": True}, {}):
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                   extra_body={**body, **extra})
            counted = http.post("/tokenize", json={"messages": messages, **body, **extra}).json()["count"]
            assert reply.usage.prompt_tokens == counted, (body, extra)
    with_bos = http.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["count"]
    without = http.post("/tokenize", json={"messages": messages, "add_special_tokens": False}).json()["count"]
    assert with_bos == without + 1


def test_vllm_request_fields(client, http):
    """vLLM's: request_id (or X-Request-Id) names the response; n null is 1; top_logprobs 0 asks nothing; a
    priority the scheduler cannot honour is refused; return_tokens_as_token_ids names logprob tokens by id."""
    by_body = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"request_id": "abc"})
    assert by_body.id == "cmpl-abc"
    by_header = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                               extra_headers={"X-Request-Id": "trace-7"})
    assert by_header.id == "chatcmpl-trace-7"
    again = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=2,
                                      extra_body={"request_id": "abc"})  # the same id twice: no clash inside
    assert again.id == "cmpl-abc" and len(again.choices) == 2
    both = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"request_id": "abc"},
                                     extra_headers={"X-Request-Id": "hdr"})  # the header wins, as in vLLM
    assert both.id == "cmpl-hdr"
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 2, "n": None, "top_logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                    extra_body={"return_tokens_as_token_ids": True})
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    named = ids.choices[0].logprobs.tokens
    assert len(named) == 3 and all(t.startswith("token_id:") for t in named)
    toks = [int(t.split(":")[1]) for t in named]
    assert http.post("/detokenize", json={"tokens": toks}).json()["prompt"] == text.choices[0].text
    assert all(k.startswith("token_id:") for k in ids.choices[0].logprobs.top_logprobs[0])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") for t in chat.choices[0].logprobs.content)


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, http):
    """vLLM's: the prompt back with its logprobs, nothing generated; streamed the same; without echo a 400."""
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    n = len(ref.choices[0].logprobs.tokens) - 1  # the reference's last token is the generated one
    assert choice.logprobs.tokens == ref.choices[0].logprobs.tokens[:n]
    assert choice.logprobs.token_logprobs == ref.choices[0].logprobs.token_logprobs[:n]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_echo_prepends_the_continued_assistant_message(client):
    messages = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=body)
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              stream=True, extra_body={**body, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        echoed.choices[0].message.content
    user_last = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0,
                                               extra_body={"echo": True})  # a new assistant turn: nothing echoed
    assert not user_last.choices[0].message.content.startswith("Tell me")
    continued = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0,
                                               extra_body={"echo": True, "add_generation_prompt": False})
    assert continued.choices[0].message.content.startswith("Tell me a story")  # continuing the user's text


def test_version_ping_and_model_permission(server, http):
    assert http.get("/version").json()["version"]
    assert httpx.get(f"{server}/ping").status_code == 200 and httpx.post(f"{server}/ping").status_code == 200
    card = http.get("/v1/models").json()["data"][0]
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]


def test_chat_full_and_stream(client):
    messages = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Tell me about a cat."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_continuous_usage_counts_each_choice(client, http):
    """vLLM's continuous_usage_stats: each chunk's usage is its own choice's prompt and output so far (chat's
    opening role chunks: no output yet), not the request's totals; the last chunk still carries the totals."""
    prompts = [PROMPT, PROMPT + " there was a big dog"]
    lens = [http.post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=1,
                                            stream=True, stream_options=opts, extra_body={"ignore_eos": True}))
    seen = {}
    for ch in chunks[:-1]:
        i = ch.choices[0].index
        seen[i] = seen.get(i, 0) + 1  # one token per engine step, one chunk per step and choice
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (lens[i // 2], seen[i])
    assert seen == {0: 5, 1: 5, 2: 5, 3: 5}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (sum(lens), 20)

    messages = [{"role": "user", "content": "Tell me about a cat."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=4, temperature=0.8,
                                                 seed=1, stream=True, stream_options=opts,
                                                 extra_body={"ignore_eos": True}))
    n_prompt = chunks[-1].usage.prompt_tokens
    assert [(ch.usage.prompt_tokens, ch.usage.completion_tokens) for ch in chunks[:2]] == [(n_prompt, 0)] * 2
    counts = {0: [], 1: []}
    for ch in chunks[2:-1]:
        counts[ch.choices[0].index].append(ch.usage.completion_tokens)
        assert ch.usage.prompt_tokens == n_prompt
    assert counts == {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]} and chunks[-1].usage.completion_tokens == 8


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    words = base.split()
    stop = " " + words[len(words) // 2]  # a word from the middle, with its leading space
    cut = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=30, temperature=0, stop=["."])
    assert "." not in chat.choices[0].message.content


def test_seeded_sampling_and_n(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # the samples of one request differ
    other = client.completions.create(n=3, **{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "The dog"], n=2, max_tokens=6, temperature=0.7,
                                    seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=5)
    chat2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=8, temperature=1.0, seed=5)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in chat2.choices]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4 and top[tok] == value
        assert value == max(top.values())  # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)


def test_return_token_ids_as_vllm(client, http):
    """vLLM's return_token_ids: the prompt's ids (what /tokenize gives) and each choice's generated ids beside the
    text; streamed, the prompt's in the first chunk and each chunk's new ids, which add up to the whole reply's."""
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    extra = {"return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                      extra_body=extra)
    for c in whole.choices:
        assert c.prompt_token_ids == prompt_ids and len(c.token_ids) == 12
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                           stream=True, extra_body=extra):
        for c in chunk.choices:
            assert (c.prompt_token_ids == prompt_ids) == (c.index not in streamed)
            streamed.setdefault(c.index, []).extend(c.token_ids)
    assert [streamed[c.index] for c in whole.choices] == [c.token_ids for c in whole.choices]
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_body=extra)
    chat_prompt = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    assert chat.prompt_token_ids == chat_prompt and len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body=extra))
    assert chunks[0].prompt_token_ids == chat_prompt and all(c.prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids or []] == chat.choices[0].token_ids
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].token_ids is None and plain.choices[0].prompt_token_ids is None


def test_prompt_logprobs_are_the_engines(client, http):
    """vLLM's prompt_logprobs extension: None for the first prompt token, then the token and the top k at each
    position, by token id, as the offline LLM computes them (with echo + logprobs asking the engine for more, the
    reply still holds k); the chat reply carries them once, beside its choices; a stream may not ask for them."""
    from nvllm import SamplingParams
    from nvllm.assets import demo_model_path
    from tests.conftest import make_llm

    ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    want = make_llm(demo_model_path()).generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2),
                                                use_tqdm=False)[0]
    assert len(want.prompt_token_ids) == ids
    for extra in ({}, {"echo": True, "logprobs": 4}):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                               "prompt_logprobs": 2, **extra}).json()
        got = r["choices"][0]["prompt_logprobs"]
        assert got[0] is None and len(got) == ids
        for tok, d, w in zip(want.prompt_token_ids[1:], got[1:], want.prompt_logprobs[1:]):
            assert str(tok) in d and {int(t) for t in d} == {t for t, lp in w.items() if lp.rank <= 2 or t == tok}
            for t, lp in d.items():
                assert lp["rank"] == w[int(t)].rank and lp["decoded_token"]
                assert lp["logprob"] == pytest.approx(w[int(t)].logprob, abs=1e-4)
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(d) == 1 for d in chat["prompt_logprobs"][1:])
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs_whole_and_streamed(client):
    """The prompt's tokens then the completion's, their text offsets running on without a step back, and the
    same logprobs streamed (the echo chunk carries the prompt's) as answered whole."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 6 and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].text == PROMPT and len(chunks[0].logprobs.tokens) == n_prompt
    streamed = [(t, v, o) for c in chunks for t, v, o in zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                                             c.logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))


# ---- concurrency and disconnects -----------------------------------------------------------------------------
PROMPTS = [f"{start} {who}" for start in ("Once upon a time there was", "One day", "The little", "Lily saw a",
                                          "Tom and his mom went to the", "In the park,", "It was a sunny day and",
                                          "The big red")
           for who in ("a cat", "a dog", "a girl named Sue", "Ben", "the bird", "a tree", "his toy", "the sun")]


def test_64_concurrent_streams_match_alone(server, client):
    assert len(PROMPTS) == 64
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0]
             for p in PROMPTS]

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        text, finish = "", None
        async for ch in await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                    stream=True):
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in PROMPTS))

    together = asyncio.run(all_at_once())
    assert together == [(c.text, c.finish_reason) for c in alone]


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


def test_openai_client_sees_typed_errors(client):
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
