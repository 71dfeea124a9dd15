"""A request's tokenization runs on the server's tokenizer thread, so a prompt that takes long to tokenize does not
hold up the event loop (every other request and stream). In process, with the demo model's tokenizer: the handler's
``start`` is awaited while the tokenizer is made to block, and the loop must keep running meanwhile."""

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
from nvllm.serve.prompts import PromptProcessor
from nvllm.serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_MODEL_LEN = 8
LONG = "the cat sat on the mat " * 10  # over MAX_MODEL_LEN tokens: start ends in a 400 before the engine


def _blocked_handlers():
    """A completion and a chat handler over a tokenizer whose ``encode`` waits for ``release``; ``entered`` is set
    (with the thread's name) once a call is inside it."""
    tokenizer = load_tokenizer(demo_model_path())
    entered, release, where = threading.Event(), threading.Event(), []
    encode = tokenizer.encode

    def blocking(*args, **kwargs):
        where.append(threading.current_thread().name)
        entered.set()
        release.wait(10)
        return encode(*args, **kwargs)

    tokenizer.encode = blocking
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
    assert where and all(name.startswith("nvllm-tokenize") for name in where)
