"""`nvllm router`: one OpenAI endpoint in front of prefill and decode workers — or of mixed replicas.

Disaggregated (--prefill URLS --decode URLS), per request:
  1. the least-loaded prefill worker runs the prompt (POST /internal/prefill with the client's request, which it
     validates exactly as /v1 would: its 4xx goes back to the client as is) and answers the handoff;
  2. the least-loaded decode worker gets the request and the handoff (POST /internal/decode), fetches the KV
     from the prefill worker over the transfer group, and answers as /v1 would — the router relays it (SSE
     events whole, or the JSON body);
  3. if no decode worker takes it, the router tells the prefill worker to release the held KV.
A worker that fails is marked down and counted; a stream cut by a dying decode worker ends with an error event
and [DONE]; every other failure is an OpenAI error JSON (503), and the router serves on with the workers left.

Mixed (--mixed URLS): each request goes whole to the least-loaded replica.

The Responses API (POST /v1/responses) goes whole to one worker, a mixed replica or a decode worker (which prefills it
itself): its stored responses live in that worker's memory, so a follow-up that names one (previous_response_id), and
GET /v1/responses/{id}, go to the worker that made it (nvllm.disagg.response_owners).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from urllib.parse import quote

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nvllm.disagg.response_owners import ResponseOwners
from nvllm.disagg.router_config import RouterConfig
from nvllm.disagg.router_metrics import RouterMetrics
from nvllm.disagg.worker_pool import Worker, WorkerPool
from nvllm.serve.errors import APIError
from nvllm.serve.http import SSE_DONE, ClientGone, check_api_key, json_object, read_body, sse, until_disconnect
from nvllm.serve.response_events import EventTrack

logger = logging.getLogger("nvllm")
# The events that end a Responses stream (it has no [DONE]).
_RESPONSES_LAST = ("event: response.completed", "event: response.incomplete", "event: response.failed", "event: error")
# The router drops a connection to a worker after this long idle: well inside any server's keep-alive (uvicorn's
# default is 5 s), so it never sends a request on a connection that the worker is closing at that moment.
_IDLE_S = 2.0


class Router:
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512,
                                                            keepalive_expiry=_IDLE_S))
        self.pool = WorkerPool(cfg.prefill, cfg.decode, cfg.mixed, self.client, cfg.api_key)
        self.metrics = RouterMetrics(self.pool)
        self.responses = ResponseOwners()
        self._tasks: set[asyncio.Task] = set()  # background releases, referenced until they end

    # ---- a request ---------------------------------------------------------------------------------------
    async def route(self, endpoint: str, request: Request) -> Response:
        try:
            check_api_key(request, self.cfg.api_key)
            body = await read_body(request, self.cfg.max_request_bytes)
            data = json_object(body)
        except APIError:  # refused here, before any worker: the client's mistake all the same
            self.metrics.outcome("client_error")
            raise
        headers = _forwarded(request)
        t0 = time.perf_counter()
        if not self.pool.disaggregated:  # the client's bytes as they came: within the replica's limit as here
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            upstream, worker = await self._open("mixed", path, body, headers, request)
            return await self._answer(upstream, worker, request, t0)
        prefill = self.pool.pick("prefill")
        if prefill is None or self.pool.pick("decode") is None:  # nothing to prefill for
            self.metrics.outcome("failed")
            raise APIError(503, f"no {'prefill' if prefill is None else 'decode'} worker is up",
                           code="no_worker_available")
        call_id = uuid.uuid4().hex
        try:
            with self.pool.busy(prefill):
                resp = await until_disconnect(request, self.client.post(
                    prefill.url + "/internal/prefill", headers=headers,
                    content=_envelope({"endpoint": endpoint, "request": data, "call_id": call_id})))
        except ClientGone:  # the prefill worker sees the disconnect too, unless its handoff was already on the way:
            self.metrics.outcome("client_gone")   # what it holds for this call is released by name
            await self._release(prefill, [], headers, calls=[call_id])
            return Response(status_code=499)
        except httpx.HTTPError as e:
            self._failed(prefill, "prefill", e)
            self.metrics.outcome("failed")
            raise APIError(503, f"the prefill worker failed: {_describe(e)}", code="worker_failed") from None
        if resp.status_code != 200:
            return self._relay_error(resp, prefill, "prefill")
        handoff = resp.json()
        handoff["url"] = prefill.url
        handles = [s["handle"] for r in handoff["requests"] for s in r["samples"] if s.get("handle")]
        t1 = time.perf_counter()
        self.metrics.prefill.observe(t1 - t0)

        async def release() -> None:  # what the decode worker will not fetch now (the rest is a no-op)
            await self._release(prefill, handles, headers)

        try:
            upstream, worker = await self._open("decode", "/internal/decode", _envelope(
                {"endpoint": endpoint, "request": data, "prefill": handoff}), headers, request)
        except BaseException:
            await release()
            raise
        if upstream.status_code != 200:
            await release()
        elif _streams(upstream):
            self.metrics.handoff.observe(time.perf_counter() - t1)
        return await self._answer(upstream, worker, request, t0, release)

    async def respond(self, request: Request) -> Response:
        """POST /v1/responses: whole to a mixed replica or a decode worker; a follow-up to the worker that holds the
        response it continues (if that worker is down, another answers that it does not know the id)."""
        try:
            check_api_key(request, self.cfg.api_key)
            body = await read_body(request, self.cfg.max_request_bytes)
            data = json_object(body)
        except APIError:
            self.metrics.outcome("client_error")
            raise
        t0 = time.perf_counter()
        upstream, worker = await self._open(self._whole_role, "/v1/responses", body, _forwarded(request), request,
                                            self.responses.owner(data.get("previous_response_id")))
        return await self._answer(upstream, worker, request, t0, responses=True)

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id}: from the worker that made it; an id the router has not seen, from the first
        worker that knows it (404 when none does)."""
        check_api_key(request, self.cfg.api_key)
        owner = self.responses.owner(response_id)
        workers = [w for w in self.pool.candidates(self._whole_role) if owner is None or w.url == owner]
        if not workers:
            raise APIError(503, f"the {self._whole_role} worker holding response {response_id!r} is down",
                           code="no_worker_available")
        for worker in workers:
            try:
                r = await self.client.get(f"{worker.url}/v1/responses/{_path_segment(response_id)}",
                                          headers=_forwarded(request), timeout=10.0)
            except httpx.HTTPError as e:
                self._failed(worker, "responses", e)
                continue
            if r.status_code != 404 or worker is workers[-1]:
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
        raise APIError(503, "no worker answered", code="no_worker_available")

    @property
    def _whole_role(self) -> str:
        """The workers that take a request whole."""
        return "decode" if self.pool.disaggregated else "mixed"

    async def _open(self, role: str, path: str, body: bytes, headers: list, request: Request,
                    prefer: str | None = None) -> tuple[httpx.Response, Worker]:
        """Send the request to the least-loaded worker of the role that accepts a connection (the worker at URL
        ``prefer`` first, if it is up); the response is open (stream) and counted in the worker's in-flight until
        _answer closes it."""
        workers = self.pool.candidates(role)
        workers.sort(key=lambda w: w.url != prefer)
        for worker in workers:
            worker.in_flight += 1
            try:
                req = self.client.build_request("POST", worker.url + path, content=body, headers=headers)
                return await until_disconnect(request, self.client.send(req, stream=True)), worker
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # it never saw the request: try the next
                worker.in_flight -= 1
                self._failed(worker, role, e)
            except ClientGone:
                worker.in_flight -= 1
                self.metrics.outcome("client_gone")
                raise APIError(499, "the client went away") from None
            except httpx.HTTPError as e:
                worker.in_flight -= 1
                self._failed(worker, role, e)
                self.metrics.outcome("failed")
                raise APIError(503, f"the {role} worker failed: {_describe(e)}", code="worker_failed") from None
            except BaseException:  # anything else (a cancelled task) leaves the count as it found it
                worker.in_flight -= 1
                raise
        self.metrics.outcome("failed")
        raise APIError(503, f"no {role} worker is up", code="no_worker_available")

    async def _answer(self, upstream: httpx.Response, worker: Worker, request: Request,
                      t0: float, release=None, responses: bool = False) -> Response:
        """Relay the worker's answer; release(): called when the worker fails or the client leaves before it is
        complete (the prefill worker's handles that the decode worker has not taken yet); responses: a Responses API
        answer, whose id is noted as the worker's."""
        if upstream.status_code != 200:
            try:
                await upstream.aread()
            finally:
                await upstream.aclose()
                worker.in_flight -= 1
            return self._relay_error(upstream, worker, worker.role)
        if _streams(upstream):
            closed = False

            async def close(complete: bool = False) -> None:  # once: when the relay ends, or when the client left
                nonlocal closed                                     # before it began
                if not closed:
                    closed = True
                    worker.in_flight -= 1
                    await upstream.aclose()
                    if not complete and release is not None:
                        self._background(release())  # not awaited: the client's task may be cancelled here

            return _RelayResponse(self._relay(upstream, worker, t0, close, release, responses), close)
        try:
            body = await until_disconnect(request, upstream.aread())
        except ClientGone:
            self.metrics.outcome("client_gone")
            if release is not None:
                await release()
            return Response(status_code=499)
        except httpx.HTTPError as e:
            self._failed(worker, worker.role, e)
            self.metrics.outcome("failed")
            if release is not None:
                await release()
            raise APIError(503, f"the {worker.role} worker failed: {_describe(e)}", code="worker_failed") from None
        finally:
            await upstream.aclose()
            worker.in_flight -= 1
        self.metrics.outcome("ok")
        self.metrics.e2e.observe(time.perf_counter() - t0)
        if responses:
            self.responses.note_body(body, worker.url)
        return Response(body, media_type="application/json")

    async def _relay(self, upstream: httpx.Response, worker: Worker, t0: float, close, release=None,
                     responses: bool = False):
        """The worker's SSE events, whole; a stream cut short ends with an error event and [DONE] (a Responses
        stream, which has no [DONE], with its own error event)."""
        done, error, event, start, watch, track = False, None, [], t0, responses, EventTrack()
        last = _RESPONSES_LAST if responses else ("data: [DONE]",)
        try:
            async for line in upstream.aiter_lines():
                if line:
                    event.append(line)
                    continue
                if not event:
                    continue
                text, event = "\n".join(event) + "\n\n", []
                if not done and text.startswith(last):
                    done = True
                if watch and self.responses.note_event(text, worker.url):
                    watch = False
                if t0:
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                    t0 = 0.0
                track.note(text)
                yield text
        except httpx.HTTPError as e:
            error = e
            self._failed(worker, worker.role, e)
        except BaseException:  # the client went away: closing the upstream aborts the request there
            self.metrics.outcome("client_gone")
            raise
        finally:
            await close(done)  # not done: what the decode worker did not take is released
        if done:
            self.metrics.outcome("ok")
            self.metrics.e2e.observe(time.perf_counter() - start)
            return
        self.metrics.outcome("failed")
        why = _describe(error) if error is not None else "the stream ended early"
        message = f"the {worker.role} worker failed mid-stream: {why}"
        if responses:
            for text in track.failure("worker_failed", message, None):
                yield text
            return
        yield sse({"error": {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}})
        yield SSE_DONE

    def _background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _relay_error(self, resp: httpx.Response, worker: Worker, role: str) -> Response:
        # a worker that answers 5xx is marked down, except for a handoff it refused (the two workers disagree on
        # one request's weights, an adapter's files: the worker itself serves the rest)
        if resp.status_code >= 500 and _error_code(resp) != "handoff_mismatch":
            self._failed(worker, role, f"HTTP {resp.status_code}")
        self.metrics.outcome("client_error" if resp.status_code < 500 else "failed")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    def _failed(self, worker: Worker, stage: str, error) -> None:
        self.metrics.failures.labels(worker.role, worker.url, stage).inc()
        self.pool.failed(worker, error if isinstance(error, str) else _describe(error))

    async def _release(self, prefill: Worker, handles: list[str], headers: list, calls: list[str] = ()) -> None:
        if not handles and not calls:
            return
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(prefill.url + "/internal/kv/release", json={"handles": handles,
                                                                               "calls": list(calls)},
                                   headers=headers, timeout=5.0)

    # ---- the rest ----------------------------------------------------------------------------------------
    async def any_worker(self, request: Request, path: str) -> Response:
        """A request any worker answers alike (the model list, /tokenize, /detokenize: every worker serves the same
        model and tokenizer), relayed from the first worker up that answers; 503 when none does."""
        check_api_key(request, self.cfg.api_key)
        body = await read_body(request, self.cfg.max_request_bytes) if request.method == "POST" else None
        for role in ("mixed", "prefill", "decode"):
            for worker in self.pool.candidates(role):
                try:
                    r = await self.client.request(request.method, worker.url + path, headers=_forwarded(request),
                                                  content=body, timeout=10.0)
                except httpx.HTTPError as e:
                    self._failed(worker, path.rsplit("/", 1)[-1], e)
                    continue
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
        raise APIError(503, "no worker is up", code="no_worker_available")

    def healthy(self) -> bool:
        up = {w.role for w in self.pool.workers if w.up}
        return "mixed" in up if not self.pool.disaggregated else {"prefill", "decode"} <= up

    async def background(self) -> None:
        """Poll the workers; log a line every log_interval seconds."""
        last = time.monotonic()
        while True:
            try:
                await self.pool.poll_all()
            except Exception:  # noqa: BLE001 - polling must outlive any one failure, or no worker comes back up
                logger.exception("polling the workers failed; polling again in %.1f s", self.cfg.poll_interval)
            if self.cfg.log_interval > 0 and time.monotonic() - last >= self.cfg.log_interval:
                self.metrics.log_line()
                last = time.monotonic()
            await asyncio.sleep(self.cfg.poll_interval)


class _RelayResponse(StreamingResponse):
    """SSE relayed from a worker; `close` (closing the upstream, which aborts the request there) always runs,
    even when the client leaves before the first event and the event generator never starts."""

    def __init__(self, events, close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _error_code(resp: httpx.Response) -> str | None:
    """The OpenAI error body's code, if the answer is one."""
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _streams(upstream: httpx.Response) -> bool:
    """Whether the worker answers with events: what it parsed the request's ``stream`` as (pydantic takes "false"
    and 0 for False, where the JSON value's truth would not)."""
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


def _forwarded(request: Request) -> list[tuple[bytes, bytes]]:
    """The client's headers a worker reads: its key, and the X-Request-Id that names the response — as the bytes
    that came (a header of non-ASCII bytes, which a server reads as Latin-1, is no error)."""
    kept = [(k, v) for k, v in request.headers.raw if k.lower() in (b"authorization", b"x-request-id")]
    return [(b"content-type", b"application/json"), *kept]


def _envelope(call: dict) -> bytes:
    """A worker's internal call, its text as written (not escaped to ASCII: six times the bytes)."""
    return json.dumps(call, ensure_ascii=False).encode()


def _path_segment(value: str) -> str:
    """``value`` as one URL path segment: every reserved or control character escaped, dots too (a URL library
    resolves ``..``)."""
    return quote(value, safe="").replace(".", "%2E")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
