"""`nvllm serve` end to end: the real server started once as a subprocess on a free port (the demo model),
driven with the official `openai` client and raw httpx for what the client will not send."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.server_utils import assert_keeps_idle_connection, http_client, openai_client, start_server

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
    return openai_client(server, KEY)


@pytest.fixture(scope="module")
def http(server):
    with http_client(server, KEY) as c:
        yield c


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
