"""A request's tokenization runs on the server's tokenizer threads, so a prompt that takes long to tokenize does not
hold up the event loop (every other request and stream), and a large prompt does not hold up small ones. In process,
with the demo model's tokenizer: the handler's ``start`` is awaited while the tokenizer is made to block, and the
loop (and the other lane) must keep running meanwhile."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nvllm.assets import demo_model_path
from nvllm.engine.tokenizer import load_tokenizer
from nvllm.serve.chat import ChatHandler
from nvllm.serve.completions import CompletionHandler
from nvllm.serve.errors import APIError
from nvllm.serve.models import ServedModels
from nvllm.serve.prompts import LARGE_PROMPT_CHARS, PromptProcessor, text_size
from nvllm.serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_MODEL_LEN = 8
LONG = "the cat sat on the mat " * 10  # over MAX_MODEL_LEN tokens: start ends in a 400 before the engine


def _blocked_handlers(longer_than: int = 0):
    """A completion and a chat handler over a tokenizer whose ``encode`` of a text of more than ``longer_than``
    characters waits for ``release``; ``entered`` is set (with the thread's name and the tokenizer) once a call is
    inside it."""
    tokenizer = load_tokenizer(demo_model_path())
    entered, release, where = threading.Event(), threading.Event(), []
    encode = tokenizer.encode

    def blocking(self, text, *args, **kwargs):
        if len(text) > longer_than:
            where.append((threading.current_thread().name, self))
            entered.set()
            release.wait(10)
        return encode.__func__(self, text, *args, **kwargs)

    tokenizer.encode = blocking.__get__(tokenizer)  # bound to each copy the lanes make (deepcopy rebinds it)
    prompts = PromptProcessor(tokenizer, 512, MAX_MODEL_LEN)
    models = ServedModels("stories260K", "", MAX_MODEL_LEN)
    return (CompletionHandler(None, prompts, models, {}), ChatHandler(None, prompts, models, {}),
            entered, release, where)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_long_tokenization_leaves_the_event_loop_running(endpoint):
    completions, chat, entered, release, where = _blocked_handlers()
    if endpoint == "completions":
        start = completions.start(CompletionRequest(prompt=LONG))
    else:
        start = chat.start(ChatCompletionRequest(messages=[{"role": "user", "content": LONG}]))

    async def main():
        task = asyncio.ensure_future(start)
        while not entered.is_set():  # the loop turns while the request's tokenization has not begun or blocks
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not task.done(), "the tokenizer blocked the event loop until it returned"
        release.set()
        with pytest.raises(APIError) as e:
            await task
        return e.value

    err = asyncio.run(main())
    assert err.status == 400 and "maximum context length" in err.message
    assert where and all(name.startswith("nvllm-tokenize") for name, _ in where)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_large_prompt_does_not_hold_up_small_ones(endpoint):
    """A request of more than LARGE_PROMPT_CHARS characters is tokenized in its own lane, with its own tokenizer:
    while it blocks there, a small request is answered."""
    completions, chat, entered, release, where = _blocked_handlers(longer_than=len(LONG) + 100)
    large = "the cat " * (LARGE_PROMPT_CHARS // 8 + 1)

    def start(prompt: str):
        if endpoint == "completions":
            return completions.start(CompletionRequest(prompt=prompt))
        return chat.start(ChatCompletionRequest(messages=[{"role": "user", "content": prompt}]))

    async def main():
        task = asyncio.ensure_future(start(large))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as small:  # answered (a 400: too long for MAX_MODEL_LEN) while the large blocks
            await asyncio.wait_for(start(LONG), 5)
        assert not task.done()
        release.set()
        with pytest.raises(APIError) as e:
            await task
        return small.value, e.value

    small, err = asyncio.run(main())
    assert small.status == 400 and err.status == 400 and "maximum context length" in err.message
    assert [name.split("_")[0] for name, _ in where] == ["nvllm-tokenize-large"]
    assert where[0][1] is not completions.prompts._tokenizer  # the lane's own copy: no tokenizer shared by threads


def test_text_size_counts_a_requests_text():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 70000}]}])
    assert text_size((chat,)) > LARGE_PROMPT_CHARS
    assert text_size((CompletionRequest(prompt=[1, 2, 3]),)) < 100
    assert text_size(({"prompt": ["ab", "cde"]},)) == 5


def _health_while_blocked(monkeypatch, owner, name: str, path: str, body: dict):
    """POST ``body`` to ``path`` of an in-process server on the demo model while ``owner.name`` (patched) blocks;
    /health must be answered meanwhile. The (health, reply) responses."""
    import httpx

    from nvllm.config import EngineConfig
    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.serve.api_server import ServerConfig, build_app

    original, entered, release = getattr(owner, name), threading.Event(), threading.Event()

    def blocking(*args, **kwargs):
        entered.set()
        release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, blocking)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=demo_model_path(), device="cpu", log_stats_interval=0)))
    app = build_app(engine, ServerConfig(), "stories260K")
    engine.start()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            task = asyncio.ensure_future(client.post(path, json=body))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            health = await asyncio.wait_for(client.get("/health"), 5)  # answered while the call blocks
            assert not task.done()
            release.set()
            return health, await task

    try:
        return asyncio.run(main())
    finally:
        release.set()
        asyncio.run(engine.shutdown())


def test_detokenize_runs_off_the_event_loop(monkeypatch):
    """/detokenize of millions of ids takes seconds: it runs on a tokenizer thread, as /tokenize does, while the
    loop answers /health."""
    health, detok = _health_while_blocked(monkeypatch, PromptProcessor, "decode", "/detokenize",
                                          {"tokens": [1, 100, 200]})
    assert health.status_code == 200 and detok.status_code == 200 and detok.json()["prompt"]


@pytest.mark.parametrize("endpoint,blocked", [("chat", "nvllm.serve.chat.chat_logprobs"),
                                              ("completions", "nvllm.serve.completions.completion_logprobs"),
                                              ("completions", "nvllm.serve.api_server._json_response")])
def test_a_large_response_is_built_and_encoded_off_the_event_loop(endpoint, blocked, monkeypatch):
    """n = 128 samples with 20 top logprobs each make a response of tens of megabytes, seconds to build and encode:
    both run off the loop, which answers /health meanwhile (it had stalled every request and probe for 17 s)."""
    import importlib

    module, name = blocked.rsplit(".", 1)
    body = {"model": "stories260K", "max_tokens": 3, "logprobs": 2}
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": "Once"}], logprobs=True, top_logprobs=2)
    else:
        body.update(prompt="Once")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    health, reply = _health_while_blocked(monkeypatch, importlib.import_module(module), name, path, body)
    assert health.status_code == 200 and reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["logprobs"]
