"""HTTP plumbing the endpoints share: the API-key check, reading a size-limited JSON body into a schema,
Server-Sent Events framing, racing a request's work against the client going away, and building whole responses
off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from nvllm.serve.errors import APIError, bad_request, validation_message

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the JSON escape of a UTF-16 surrogate, D800-DFFF

logger = logging.getLogger("nvllm")

# Whole responses are built and encoded here: n samples with top logprobs make tens of megabytes, seconds of work
# that on the loop had stalled every other request and /health. Threads of their own, so that a few large builds do
# not hold up the default executor's work (structured-output compiles, shutdown).
_RESPONSE_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvllm-respond")


async def on_response_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a response thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_RESPONSE_THREADS, functools.partial(fn, *args))


def probe_routes(app, health) -> None:
    """vLLM's probes beside an app's /health (``health``): /ping (SageMaker's check; GET or POST) answers as it does,
    /version names the package's."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version() -> dict:
        from nvllm import __version__

        return {"version": __version__}


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, schema: type[M], limit: int) -> M:
    return parse_json(await read_body(request, limit), schema)


def parse_json(body: bytes, schema: type[M]) -> M:
    """A JSON object body → the schema; 400 naming what is wrong. Fields the schema does not know are ignored, with
    a warning naming them (as vLLM logs them): a client's field this server lacks never passes unnoticed."""
    data = json_object(body)
    model = parse_model(data, schema)
    known = set(schema.model_fields) | {f.alias for f in schema.model_fields.values() if f.alias}
    ignored = sorted(set(data) - known)
    if ignored:
        logger.warning("the request's fields %s are not used by this server and were ignored", ", ".join(ignored))
    return model


def json_object(body: bytes) -> dict:
    """The body as a JSON object, or 400: not JSON, nested past Python's recursion limit, not an object, or text
    that is not Unicode (a lone surrogate escape such as \\ud800, which no tokenizer or reply can encode)."""
    try:
        data = json.loads(body)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more digits than int() takes
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):  # only an escape makes a surrogate; a pair of them is one valid character
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request("the request body holds an unpaired UTF-16 surrogate (\\uD800-\\uDFFF): not valid "
                              "Unicode text", code="invalid_json") from None
    return data


def parse_model(data: dict, schema: type[M]) -> M:
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise bad_request(message, param) from None


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # let its cleanup (the abort) run
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame an endpoint's chunk generator: errors mid-stream become an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": "invalid_request_error", "param": e.param,
                             "code": e.code}})
    except Exception as e:  # noqa: BLE001 - the status line is long gone; report inside the stream
        yield sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "param": None,
                             "code": None}})
    yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """SSE response that always cleans up when it ends — its chunk generator is closed and `on_close` runs
    (aborting the engine requests) — even when the client disconnects before the first chunk, so a client
    that goes away frees its KV blocks at once rather than whenever the generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None],
                 framing: Callable[[AsyncIterator[str]], AsyncIterator[str]] = sse_stream):
        super().__init__(framing(chunks), headers={"Cache-Control": "no-cache"})
        self._chunks, self._on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()
            await self._chunks.aclose()
