"""Disaggregated serving end to end on the CPU (gloo, real processes on localhost): `nvllm router` in front of one
prefill and two decode workers (`nvllm serve --role …`) against one mixed `nvllm serve`, the official `openai`
client on both; then a worker's death (`nvllm serve --disaggregate 1P1D` and the flags: test_disagg_cli)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import openai
import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import assert_keeps_idle_connection, spawn, start_server
from tests.test_serve import PROMPTS
from tests.test_serve_bad_input import BAD_REQUESTS

KEY = "sk-disagg"
MODEL = "stories260K"
SENT = ("queue", "gather", "send")  # the prefill side's transfer phases
COMMON = ["--device", "cpu", "--max-model-len", "256", "--log-stats-interval", "0", "--uvicorn-log-level", "warning",
          "--api-key", KEY, "--max-request-bytes", "65536"]
MAX_PREFILL = 200
AUTH = {"Authorization": f"Bearer {KEY}"}


def _wait_healthy(procs: dict[str, subprocess.Popen], urls: dict[str, str], logs: dict, names: list[str],
                  timeout: float = 120) -> None:
    """Until every process of ``names`` answers /health (workers of a group wait for each other, so all are
    watched); one that exits, or never answers, fails the test."""
    deadline = time.monotonic() + timeout
    waiting = list(names)
    while waiting:
        for name in list(waiting):
            if procs[name].poll() is not None:
                pytest.fail(f"{name} exited with {procs[name].returncode}:\n{logs[name].read_text()}")
            try:
                if httpx.get(f"{urls[name]}/health", timeout=2).status_code == 200:
                    waiting.remove(name)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            for name in waiting:
                procs[name].kill()
            pytest.fail("did not become healthy: " + "\n".join(f"{n}:\n{logs[n].read_text()}" for n in waiting))
        time.sleep(0.2)


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """{"urls": {"mixed", "router", "prefill", "decode0", "decode1"}, "procs": {...}, "logs": {...}}: the prefill
    worker and two decode workers in one KV group, whose store this process serves (as `--disaggregate` does),
    the router, and a mixed server. Every process started is stopped at the end, also when the set-up fails
    halfway."""
    d = tmp_path_factory.mktemp("disagg")
    procs, urls, logs = {}, {}, {}
    pool = ThreadPoolExecutor(1)
    mixed = pool.submit(start_server, COMMON, d / "mixed.log")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    group = ["--kv-world-size", "3", "--kv-master", f"127.0.0.1:{store.port}", "--kv-store-external"]
    try:
        for name, role, rank, extra in (("prefill", "prefill", 0, ["--max-prefill-length", str(MAX_PREFILL)]),
                                        ("decode0", "decode", 1, []), ("decode1", "decode", 2, [])):
            logs[name] = d / f"{name}.log"
            procs[name], urls[name] = spawn("serve", [*COMMON, "--role", role, "--kv-rank", str(rank), *group,
                                                      *extra], logs[name])
        _wait_healthy(procs, urls, logs, ["prefill", "decode0", "decode1"])
        logs["router"] = d / "router.log"
        procs["router"], urls["router"] = spawn(
            "router", ["--prefill", urls["prefill"], "--decode", f"{urls['decode0']},{urls['decode1']}",
                       "--api-key", KEY, "--max-request-bytes", "65536", "--poll-interval", "30",
                       "--uvicorn-log-level", "warning"], logs["router"])
        _wait_healthy(procs, urls, logs, ["router"])
        procs["mixed"], urls["mixed"] = mixed.result()
        yield {"urls": urls, "procs": procs, "logs": logs}
    finally:
        pool.shutdown(wait=True)
        if "mixed" not in procs and mixed.exception() is None:
            procs["mixed"] = mixed.result()[0]
        _stop(procs)
        del store  # after the workers: the group's store outlives them


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _info(url: str) -> dict:
    return httpx.get(f"{url}/internal/info", headers=AUTH, timeout=10).json()


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if not s.name.endswith(("_bucket", "_created")):
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}[{label}]" if label else s.name] = s.value
    return out


def _wait_pool_empty(url: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(url)
        if info["num_free_blocks"] == info["num_blocks"] and not info["held"] and not info["running"]:
            return info
        assert time.monotonic() < deadline, f"{url} still holds blocks: {info}"
        time.sleep(0.05)


# ---- the same answers as one mixed server --------------------------------------------------------------------
async def _all(url: str, stream: bool) -> list[tuple]:
    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple:
        if not stream:
            r = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens
        text, finish, usage = "", None, None
        async for ch in await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            usage = ch.usage or usage
        return text, finish, usage.prompt_tokens, usage.completion_tokens

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
        return await asyncio.gather(*(one(ac, p) for p in PROMPTS[::2]))


@pytest.mark.parametrize("stream", [False, True])
def test_32_concurrent_requests_match_a_mixed_server(deployment, stream):
    urls = deployment["urls"]
    want = asyncio.run(_all(urls["mixed"], stream))
    got = asyncio.run(_all(urls["router"], stream))
    assert len(got) == 32 and got == want
    assert all(text and finish in ("stop", "length") for text, finish, _, _ in got)
    counts = [_info(u)["transfer"]["transfers_ok"] for u in (urls["decode0"], urls["decode1"])]
    assert min(counts) > 0  # both decode workers took requests (least-loaded picking)


def test_chat_stop_strings_logprobs_seeds_and_constraints_match(deployment):
    router, mixed = _client(deployment["urls"]["router"]), _client(deployment["urls"]["mixed"])
    messages = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Tell me about a cat."}]
    calls = [
        ("chat", dict(messages=messages, max_tokens=20, temperature=0)),
        ("chat", dict(messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)),
        ("chat", dict(messages=messages, max_tokens=12, temperature=1.0, seed=5, n=2)),
        ("completions", dict(prompt=PROMPTS[3], max_tokens=40, temperature=0, stop=[" the", "zzz"])),
        ("completions", dict(prompt=PROMPTS[5], max_tokens=6, temperature=0, logprobs=3, echo=True)),
        ("completions", dict(prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=10, temperature=0.8, seed=11, n=2)),
        ("completions", dict(prompt=PROMPTS[7], max_tokens=1, temperature=0)),  # done at the prefill worker
        # penalties: the first token's at the prefill worker, the rest's (counting that token) at the decode worker
        ("completions", dict(prompt=PROMPTS[4], max_tokens=24, temperature=0, frequency_penalty=1.5,
                             presence_penalty=0.5, logit_bias={"13": -3}, extra_body={"repetition_penalty": 1.3})),
        ("chat", dict(messages=messages, max_tokens=16, temperature=0, presence_penalty=2.0,
                      extra_body={"repetition_penalty": 1.2})),
        ("completions", dict(prompt=PROMPTS[6], max_tokens=6, temperature=0, extra_body={"cache_salt": "tenant"})),
        # structured outputs: the decode worker's matcher starts past the prefill worker's first token
        ("completions", dict(prompt=PROMPTS[2], max_tokens=20, temperature=1.0, seed=3, n=3,
                             extra_body={"guided_regex": r"[a-z]{2,6}-\d{1,3}"})),
        ("chat", dict(messages=messages, max_tokens=40, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "pet", "schema": {
                "type": "object", "required": ["name", "age"], "additionalProperties": False, "properties": {
                    "name": {"enum": ["Tom", "Lily"]}, "age": {"type": "integer", "maximum": 99}}}}})),
    ]
    for kind, kw in calls:
        api = (lambda c: c.chat.completions) if kind == "chat" else (lambda c: c.completions)
        a, b = api(router).create(model=MODEL, **kw), api(mixed).create(model=MODEL, **kw)
        strip = {"id", "created"}
        assert a.model_dump(exclude=strip) == b.model_dump(exclude=strip), kw
        if kind == "chat":  # streamed too: the same text and finish reasons
            chunks = list(api(router).create(model=MODEL, stream=True, **kw))
            for choice in b.choices:
                text = "".join(c.choices[0].delta.content or "" for c in chunks
                               if c.choices and c.choices[0].index == choice.index)
                assert text == choice.message.content
    _wait_pool_empty(deployment["urls"]["prefill"])


# ---- bad input, metrics, disconnects ---------------------------------------------------------------------------
ROUTED = [b for b in BAD_REQUESTS if b[1] in ("/v1/completions", "/v1/chat/completions", "/v1/models")]
ROUTED += [("prompt over --max-prefill-length", "/v1/completions", {"prompt": [1] + [300] * MAX_PREFILL}, None, 400),
           ("unknown route", "/v1/embeddings", {"input": "x"}, None, 404),
           ("a regex that does not compile", "/v1/completions", {"prompt": "hi", "guided_regex": "[a-"}, None, 400)]


@pytest.mark.parametrize("what,path,body,headers,status", ROUTED, ids=[b[0] for b in ROUTED])
def test_bad_input_at_the_router_answers_4xx(deployment, what, path, body, headers, status):
    url = deployment["urls"]["router"]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    h = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    r = httpx.get(url + path, headers=h) if body is None else httpx.post(url + path, headers=h, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if "max-prefill" in what:
        assert err["code"] == "prompt_too_long" and str(MAX_PREFILL) in err["message"]
    if "compile" in what:  # the prefill worker's 400 names the field, as a mixed server's does
        assert err["param"] == "guided_regex" and err["message"].startswith("invalid structured outputs regex")


def test_metrics_split_and_pools_drain(deployment):
    urls = deployment["urls"]
    c = _client(urls["router"])  # what the router counts, made here: the module's tests may run on other workers
    c.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=4)
    assert "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=4,
                                                                     stream=True))
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    m = _metrics(urls["router"])
    assert m["nvllm:kv_transfers_total[outcome=ok]"] > 0 and m["nvllm:kv_transfer_bytes_total"] > 0
    assert m["nvllm:kv_transfer_seconds_total"] > 0 and m["nvllm:disagg_first_decodes_total"] > 0
    phases = [m[f"nvllm:kv_transfer_phase_seconds_total[phase={p}]"] for p in ("ask", "wire", "copy")]
    assert all(v > 0 for v in phases) and sum(phases) <= m["nvllm:kv_transfer_seconds_total"]
    assert all(m[f"nvllm:kv_transfer_phase_seconds_total[phase={p}]"] > 0 for p in SENT)
    assert m["nvllm:router_prefill_seconds_count"] > 0 and m["nvllm:router_handoff_seconds_count"] > 0
    assert m["nvllm:router_requests_total[outcome=client_error]"] > 0
    bad = httpx.post(f"{urls['router']}/v1/completions", content=b'{"prompt": ', headers=AUTH)  # refused by the router
    assert bad.status_code == 400
    assert _metrics(urls["router"])["nvllm:router_requests_total[outcome=client_error]"] == \
        m["nvllm:router_requests_total[outcome=client_error]"] + 1
    assert m[f"nvllm:router_worker_up[role=prefill,worker={urls['prefill']}]"] == 1
    assert any(k.startswith("nvllm:router_worker_requests_waiting[role=decode") for k in m)
    sent = _metrics(urls["prefill"])
    assert sent["nvllm:kv_transfer_bytes_total"] == m["nvllm:kv_transfer_bytes_total"]  # sent = received
    deadline = time.monotonic() + 10  # one prefill worker: the router's sums are its own (once it has counted the
    while True:                       # last send, a moment after the receiver may have the bytes)
        own = [_metrics(urls["prefill"])[f"nvllm:kv_transfer_phase_seconds_total[phase={p}]"] for p in SENT]
        routed = [_metrics(urls["router"])[f"nvllm:kv_transfer_phase_seconds_total[phase={p}]"] for p in SENT]
        if own == routed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert own == routed
    assert sent["nvllm:engine_steps_total[kind=prefill]"] > 0 and sent["nvllm:kv_handles_held"] == 0
    assert m["nvllm:kv_recomputed_total"] == 0
    # prompt tokens by where their KV came from: computed (or found cached) by the prefill worker; received by the
    # decode workers or found in their own prefix caches, none computed there (no transfer failed)
    source = "nvllm:prompt_tokens_by_source_total[source={}]"
    assert sent[source.format("local_compute")] > 0 and sent[source.format("external_kv_transfer")] == 0
    decoded = [_metrics(urls[d]) for d in ("decode0", "decode1")]
    assert sum(d[source.format("external_kv_transfer")] for d in decoded) > 0
    assert all(d[source.format("local_compute")] == 0 for d in decoded)
    assert all(d["nvllm:prompt_tokens_cached_total"] == d["nvllm:prompt_tokens_total"] for d in decoded)
    for u in (urls["prefill"], urls["decode0"], urls["decode1"]):
        _wait_pool_empty(u)


def test_disconnected_clients_free_blocks_on_both_sides(deployment):
    urls = deployment["urls"]

    async def leave_early(ac: openai.AsyncOpenAI, i: int) -> None:
        stream = await ac.completions.create(model=MODEL, prompt=f"{PROMPTS[i]} and", max_tokens=200,
                                             stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{urls['router']}/v1", api_key=KEY, max_retries=0, timeout=60) as ac:
            await asyncio.gather(*(leave_early(ac, i) for i in range(12)))

    asyncio.run(main())
    for u in (urls["prefill"], urls["decode0"], urls["decode1"]):
        _wait_pool_empty(u)


def test_clients_that_give_up_at_any_moment_leave_no_held_kv(deployment):
    """Clients whose timeouts fall anywhere from the prefill to the first tokens, streamed or not, n=4: whatever the
    moment, the prefill worker's handles are released at once (not after --kv-handle-timeout's 60 s here), also when
    the handoff was already on its way to the router."""
    import random

    urls = deployment["urls"]
    expired = _info(urls["prefill"])["transfer"]["expired"]
    rng = random.Random(0)

    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{PROMPTS[i % 12]} and", "max_tokens": 50, "n": 4, "temperature": 1.0,
                "stream": bool(i % 2)}
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=rng.uniform(0.01, 0.3), headers=AUTH) as c:
                await c.post(urls["router"] + "/v1/completions", json=body)

    async def main():
        for k in range(3):
            await asyncio.gather(*(one(8 * k + i) for i in range(8)))

    asyncio.run(main())
    for u in (urls["prefill"], urls["decode0"], urls["decode1"]):
        _wait_pool_empty(u, timeout=10)
    assert _info(urls["prefill"])["transfer"]["expired"] == expired


def test_router_and_workers_keep_idle_connections(deployment):
    """The router and a worker both keep an idle connection past a client's 5 s (checked side by side)."""
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(assert_keeps_idle_connection, (deployment["urls"]["router"], deployment["urls"]["decode0"])))


def test_router_in_front_of_mixed_replicas(deployment, tmp_path):
    log = tmp_path / "router_mixed.log"
    proc, url = start_server(["--mixed", deployment["urls"]["mixed"], "--api-key", KEY,
                              "--uvicorn-log-level", "warning"], log, command="router")
    try:
        c, direct = _client(url), _client(deployment["urls"]["mixed"])
        kw = dict(model=MODEL, prompt=PROMPTS[20], max_tokens=10, temperature=0)
        assert c.completions.create(**kw).choices[0].text == direct.completions.create(**kw).choices[0].text
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        assert streamed == direct.completions.create(**kw).choices[0].text
        assert [m.id for m in c.models.list().data] == [MODEL]
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="hi", max_tokens=0)
        auth = {"Authorization": f"Bearer {KEY}"}  # /tokenize and /detokenize: any replica's answer, relayed
        for path, body in (("/tokenize", {"prompt": PROMPTS[20]}), ("/detokenize", {"tokens": [1, 45, 67]}),
                           ("/detokenize", {"tokens": [-1]})):
            got = httpx.post(url + path, json=body, headers=auth)
            want = httpx.post(deployment["urls"]["mixed"] + path, json=body, headers=auth)
            assert (got.status_code, got.json()) == (want.status_code, want.json())
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_responses_follow_ups_reach_the_worker_that_stored_them(deployment, tmp_path):
    """The Responses API through the router, over two mixed replicas and over the disaggregated deployment's two
    decode workers: every follow-up (previous_response_id), streamed or not, and every GET reaches the worker that
    holds the response; a stream ends as the server's own does (no [DONE])."""
    urls = deployment["urls"]
    log = tmp_path / "router_two.log"
    proc, url = start_server(["--mixed", f"{urls['mixed']},{urls['decode0']}", "--api-key", KEY,
                              "--uvicorn-log-level", "warning"], log, command="router")
    try:
        for base in (url, urls["router"]):
            c = _client(base)
            kw = dict(model=MODEL, max_output_tokens=4, temperature=0)
            ids = [c.responses.create(input="Once upon a time", **kw).id]
            for turn in range(4):
                if turn % 2:
                    events = list(c.responses.create(input="And then?", previous_response_id=ids[-1], stream=True,
                                                     **kw))
                    assert events[-1].type == "response.incomplete", events[-1]   # max_output_tokens
                    ids.append(events[-1].response.id)
                else:
                    ids.append(c.responses.create(input="And then?", previous_response_id=ids[-1], **kw).id)
            assert [c.responses.retrieve(i).id for i in ids] == ids
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve("resp_unknown")
            with pytest.raises(openai.NotFoundError):
                c.responses.create(input="x", previous_response_id="resp_unknown", **kw)
            assert httpx.post(base + "/v1/responses", json={"model": MODEL, "input": "x"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_stream_given_as_a_string_is_what_the_workers_parse(deployment):
    """pydantic reads "stream": "false" as False: the router relays what the worker answers, JSON or events."""
    body = {"model": MODEL, "prompt": PROMPTS[20], "max_tokens": 5, "temperature": 0}
    want = httpx.post(deployment["urls"]["mixed"] + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    for flag, events in (("false", False), ("0", False), ("true", True)):
        r = httpx.post(deployment["urls"]["router"] + "/v1/completions", json={**body, "stream": flag}, headers=AUTH,
                       timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream" if events else "application/json"), (flag, r.text)
        if not events:
            assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        else:
            assert r.text.rstrip().endswith("data: [DONE]") and "error" not in r.text


# ---- the benchmark and the advisor --------------------------------------------------------------------------
def test_router_passes_x_request_id_and_answers_ping_and_version(deployment):
    router = deployment["urls"]["router"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 2}
    r = httpx.post(f"{router}/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "trace-1"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-1"
    assert httpx.get(f"{router}/ping").status_code == 200 and httpx.post(f"{router}/ping").status_code == 200
    assert httpx.get(f"{router}/version").json()["version"]


def test_router_passes_what_a_mixed_server_takes(deployment):
    """Requests a mixed server answers, the router answers alike: an X-Request-Id of non-ASCII bytes (it was a 500
    that left the worker counted busy), prompt logprobs whose handoff is larger than the client's body limit (a
    413 for a 366-byte request), non-ASCII text near the limit (the router's calls had escaped it to six times the
    bytes), and stored-response ids that are not URL-safe (a 500, or another id looked up)."""
    router = deployment["urls"]["router"]
    r = httpx.post(f"{router}/v1/completions", headers=[(b"authorization", f"Bearer {KEY}".encode()),
                                                        (b"x-request-id", b"caf\xe9")],
                   json={"model": MODEL, "prompt": "Once", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-caf\xe9", r.text
    for body in ({"prompt": "the cat sat on the mat and looked at the dog " * 6, "max_tokens": 4,
                  "prompt_logprobs": 20},
                 {"prompt": "Once", "max_tokens": 4, "n": 16, "logprobs": 20, "temperature": 1.0, "seed": 1},
                 {"prompt": "Once", "max_tokens": 2, "user": "\U0001F600" * 6000}):
        r = httpx.post(f"{router}/v1/completions", headers=AUTH, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 200, r.text
    for rid in ("\x00", "a?x=1", "a#b", ".."):
        r = httpx.get(f"{router}/v1/responses/{quote(rid, safe='').replace('.', '%2E')}", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"Response with id '{rid}' not found.", r.text
    workers = httpx.get(f"{router}/router/workers", headers=AUTH).json()["workers"]
    assert not any(w["in_flight"] for w in workers), workers
    _wait_pool_empty(deployment["urls"]["prefill"])


def test_bench_serve_reports_the_disaggregation_split(deployment):
    from nvllm.bench import datasets, serve
    from nvllm.engine.llm_engine import load_tokenizer

    tok = load_tokenizer(_demo())
    requests = datasets.load_requests("random", tok, 16, input_len=40, output_len=8)
    r = serve.run_serve_benchmark(serve.ServeOptions(base_url=deployment["urls"]["router"], api_key=KEY,
                                                     progress=False, ignore_eos=True), requests, tok)
    assert r["completed"] == 16 and r["failed"] == 0
    assert r["disagg_kv_transfers"] == 16 and r["disagg_kv_bytes"] > 0 and r["disagg_kv_transfers_failed"] == 0
    for k in ("disagg_mean_prefill_ms", "disagg_mean_handoff_ms", "disagg_mean_kv_transfer_ms",
              "disagg_mean_first_decode_ms", "disagg_kv_transfer_gb_per_s"):
        assert r[k] > 0, k
    assert r["disagg_kv_recomputed"] == 0 and r["disagg_worker_failures"] == 0
    # the deployment's kernel report: what both workers ran, summed (bench printed "no kernel report" before)
    assert r["kernel_report"] and r["kernel_report"].get("attention.decode"), r["kernel_report"]
    urls = deployment["urls"]
    up = [w["url"] for w in httpx.get(f"{urls['router']}/router/workers", headers=AUTH).json()["workers"] if w["up"]]
    parts = [httpx.get(f"{u}/v1/kernel_report", headers=AUTH).json() for u in up]
    whole = httpx.get(f"{urls['router']}/v1/kernel_report", headers=AUTH).json()
    assert whole == {op: {impl: sum(p.get(op, {}).get(impl, 0) for p in parts)
                          for impl in {i for p in parts for i in p.get(op, {})}}
                     for op in {o for p in parts for o in p}}
    assert httpx.get(f"{urls['router']}/v1/kernel_report").status_code == 401


def test_advisor_against_a_live_mixed_server(deployment, tmp_path):
    import json

    from typer.testing import CliRunner

    from nvllm.cli import app

    out = tmp_path / "advice.json"
    res = CliRunner().invoke(app, ["bench", "advise", "--base-url", deployment["urls"]["mixed"], "--api-key", KEY,
                                   "--num-prompts", "24", "--input-len", "48", "--output-len", "12", "--ignore-eos",
                                   "--max-concurrency", "4",   # light load however slow the machine is
                                   "--num-gpus", "2", "--no-progress", "--save-result", str(out)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "recommendation" in res.stdout and "Prefill share of engine time" in res.stdout   # results on stdout
    saved = json.loads(out.read_text())
    w, rec = saved["workload"], saved["recommendation"]
    assert saved["mode"] == "advise" and w["num_requests"] == 24 and w["num_gpus"] == 2
    assert w["inflation_source"] == "server steps" and w["decode_step_ms"] > 0 and 0 < w["prefill_share"] < 1
    assert w["prompt_len_p50"] >= 40 and w["mean_in_flight"] <= 4 and rec["verdict"] == "stay mixed"  # short, light
    bad = CliRunner().invoke(app, ["bench", "advise", "--base-url", deployment["urls"]["mixed"], "--num-gpus", "0"])
    assert bad.exit_code == 2 and "--num-gpus" in bad.output


def _demo() -> str:
    from nvllm.assets import demo_model_path

    return demo_model_path()


# ---- a worker dies (last: it takes the deployment's decode workers down) --------------------------------------
def test_decode_worker_death_fails_its_requests_cleanly(deployment):
    urls, procs = deployment["urls"], deployment["procs"]
    router = _client(urls["router"])
    stream = router.completions.create(model=MODEL, prompt=PROMPTS[11], max_tokens=240, n=16, temperature=1.0,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    busy = [w for w in httpx.get(f"{urls['router']}/router/workers", headers=AUTH).json()["workers"]
            if w["role"] == "decode" and w["in_flight"]]
    assert len(busy) == 1
    victim = next(name for name in ("decode0", "decode1") if urls[name] == busy[0]["url"])
    procs[victim].kill()
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in it:
            pass
    _wait_pool_empty(urls["prefill"])
    # the router serves on with the decode worker left
    survivor = urls["decode1" if victim == "decode0" else "decode0"]
    before = _info(survivor)["transfer"]["transfers_ok"]
    texts = [router.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in PROMPTS[:4]]
    assert all(texts) and _info(survivor)["transfer"]["transfers_ok"] == before + 4
    workers = {w["url"]: w for w in httpx.get(f"{urls['router']}/router/workers", headers=AUTH).json()["workers"]}
    assert not workers[urls[victim]]["up"] and workers[urls[victim]]["failures"] >= 1
    # the last decode worker dies too; the router (polling every 30 s here) finds out when it hands it a request:
    # a clean 503, and the prefill worker releases the KV it held for that request
    procs["decode1" if victim == "decode0" else "decode0"].kill()
    procs["decode1" if victim == "decode0" else "decode0"].wait()
    with pytest.raises(openai.InternalServerError, match="no decode worker"):
        router.completions.create(model=MODEL, prompt=PROMPTS[12], max_tokens=6)
    assert _wait_pool_empty(urls["prefill"])["held"] == 0
    m = _metrics(urls["router"])
    assert sum(v for k, v in m.items() if k.startswith("nvllm:router_failures_total")) >= 2
    assert m["nvllm:router_requests_total[outcome=failed]"] >= 2
    assert httpx.get(f"{urls['router']}/health").status_code == 503
