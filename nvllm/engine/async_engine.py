"""AsyncLLMEngine: the engine's step loop on a background thread, beside an asyncio event loop.

The engine is not thread-safe, so only the loop thread touches it: adds and aborts travel to it through a
command list it drains before every step. Each caller reads an `OutputStream`, which the loop thread fills
through `loop.call_soon_threadsafe` (a reader far behind gets a request's later steps merged); one stream may
carry several requests (the n prompts of one HTTP call). A stream closed before its requests finish (client
gone, task cancelled) aborts them, which frees their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from typing import Any, NamedTuple

from nvllm.distributed.worker_pool import WorkerFailure
from nvllm.engine.llm_engine import LLMEngine
from nvllm.engine.kv_handoff import KVTarget
from nvllm.engine.sequence import PrefilledSample
from nvllm.lora.request import LoRARequest
from nvllm.outputs import RequestOutput
from nvllm.sampling_params import SamplingParams

logger = logging.getLogger("nvllm")

OutputHook = Callable[[list[RequestOutput]], None]


class EngineRequest(NamedTuple):
    """One engine request of an API call (OutputStream.add_many)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    cache_salt: str | None = None  # the request's prefix-cache salt (vLLM's cache_salt)
    priority: int = 0  # vLLM's request priority (scheduling_policy "priority"; must be 0 under "fcfs")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or a step failed); the request cannot be served."""


class OutputStream:
    """The outputs of one or more requests, each request's in the order the engine produced them; ends when all
    finish, or with the engine's error (nothing after it is read).

    An output is cumulative (its request so far). A reader that keeps up gets one a step; one that falls
    ``MAX_UNREAD`` steps behind a request (a client reading slowly, its socket full) has that request's newest
    unread output replaced by the next instead of one more queued, so the stream holds a bounded number of
    outputs a request: queued whole, a stalled stream of T tokens held T snapshots, O(T²) memory."""

    MAX_UNREAD = 16

    def __init__(self, engine: "AsyncLLMEngine"):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[list[RequestOutput] | BaseException] = collections.deque()  # unread, in
        # order; an output in a one-item list, so that a request's newest can be replaced where it waits
        self._newest: dict[str, list[RequestOutput]] = {}  # each request's newest unread output
        self._unread: dict[str, int] = {}  # how many of each request's outputs wait
        self._failed = False  # the engine's error is queued: the outputs after it (its aborts) are not for reading
        self._ready = asyncio.Event()
        self.pending: set[str] = set()  # requests added and not yet finished

    async def add(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams,
                  arrival_time: float | None = None, prefill_only: bool = False,
                  lora_request: LoRARequest | None = None, cache_salt: str | None = None, priority: int = 0) -> str:
        """Queue a request on the engine; raises ValueError (bad input) with nothing changed. prefill_only,
        priority: see LLMEngine.add_request."""
        request_id = request_id or uuid.uuid4().hex
        await self._engine.precompile(params)
        await self._add([request_id], lambda e: e.add_request(request_id, prompt, params,
                                                              arrival_time or time.time(), prefill_only,
                                                              lora_request=lora_request, cache_salt=cache_salt,
                                                              priority=priority),
                        emit=False)
        return request_id

    async def add_many(self, requests: Seq[EngineRequest], prefill_only: bool = False) -> None:
        """Queue the requests of one call (its prompts, its n samples) in one trip to the engine thread, all or
        none: a ValueError (bad input) leaves nothing queued. One trip per request took as long as generating
        them for a call of thousands of short prompts, time in which a client's disconnect went unnoticed.
        prefill_only: see LLMEngine.add_request (disaggregated prefill)."""
        for params in {id(r.params): r.params for r in requests}.values():
            await self._engine.precompile(params)
        now = time.time()

        def add(engine: LLMEngine) -> None:
            added: list[str] = []
            try:
                for r in requests:
                    engine.add_request(r.request_id, r.prompt_ids, r.params, now, prefill_only,
                                       lora_request=r.lora, cache_salt=r.cache_salt, priority=r.priority)
                    added.append(r.request_id)
            except BaseException:
                for request_id in added:
                    engine.abort_request(request_id)
                raise

        await self._add([r.request_id for r in requests], add, emit=False)

    async def add_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                            arrival_time: float, samples: list[PrefilledSample],
                            prompt_logprobs: list | None = None, lora_request: LoRARequest | None = None,
                            cache_salt: str | None = None, priority: int = 0, *,
                            receive: Callable[[KVTarget], None]) -> None:
        """Decode side of disaggregation: register a request a prefill worker started (LLMEngine.
        add_prefilled_request); its first output (the first tokens) is in the stream at once. ``receive`` gets
        where the prompt KV of each sequence still decoding goes, on the engine thread as the request is registered
        (and only there: nothing is returned to queue twice), so a caller cancelled before the answer comes (the
        client gone) strands no sequence: its transfer still runs, or finds the sequence aborted and frees its
        blocks."""
        await self._engine.precompile(params)

        def add(e: LLMEngine) -> None:
            targets = e.add_prefilled_request(request_id, prompt_ids, params, arrival_time, samples, prompt_logprobs,
                                              lora_request, cache_salt, priority)
            handed = 0
            try:
                for t in targets:
                    receive(t)
                    handed += 1
            except BaseException:  # nothing stays registered: the targets not handed over free their blocks here
                e.abort_request(request_id)
                for t in targets[handed:]:
                    e.handoff.arrived(t.seq, False)
                raise

        await self._add([request_id], add, emit=True)

    async def _add(self, request_ids: list[str], add: Callable[[LLMEngine], Any], emit: bool) -> Any:
        """add: queues request_ids on the engine (all, or none and raises). emit: the one request has output
        already once added (prefilled); it goes into the stream at once."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._engine._submit(("add", request_ids, add, emit, self, done))
        try:
            result = await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            for request_id in request_ids:  # the add may still land: the aborts queued behind it undo it
                self._engine.abort(request_id)
            raise
        self.pending.update(request_ids)
        return result

    def _put(self, item: RequestOutput | BaseException) -> None:  # called on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _deliver(self, item: RequestOutput | BaseException) -> None:  # on the loop
        if self._failed:  # a replaced output must not overtake the error
            return
        if isinstance(item, BaseException):
            self._failed = True
            self._queue.append(item)
        elif self._unread.get(item.request_id, 0) >= self.MAX_UNREAD:
            self._newest[item.request_id][0] = item
        else:
            self._newest[item.request_id] = slot = [item]
            self._unread[item.request_id] = self._unread.get(item.request_id, 0) + 1
            self._queue.append(slot)
        self._ready.set()

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.pending:
            raise StopAsyncIteration
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        head = self._queue.popleft()
        if isinstance(head, BaseException):
            self.pending.clear()
            raise head
        (item,) = head
        self._unread[item.request_id] -= 1
        if not self._unread[item.request_id]:
            del self._unread[item.request_id], self._newest[item.request_id]
        if item.finished:
            self.pending.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        for request_id in self.pending:
            self._engine.abort(request_id)
        self.pending.clear()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.output_hooks: list[OutputHook] = []  # run on the engine thread after every step and abort
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, OutputStream] = {}
        self._stopping = False
        self._draining = False  # abort_all(refuse_new=True) ran: new requests fail (a server shutting down)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the loop stopped, if it crashed

    # ---- life cycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            workers = getattr(self.engine.runner, "workers", None)
            if workers is not None:  # a tensor-parallel rank that dies stops the loop at once, busy or idle
                me = weakref.ref(self)  # (the pool outlives no engine: no cycle through it)
                workers.on_failure.append(lambda error: (a := me()) is not None and a._submit(("fail", error)))
            self._thread = threading.Thread(target=self._run, name="nvllm-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is still in flight (its streams end with finish_reason "abort") and stop the loop."""
        await asyncio.to_thread(self.stop, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """``shutdown`` from a thread without an event loop (a server whose shutdown was cut short: the loop ends
        before the interpreter tears down under it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests ------------------------------------------------------------------------------------
    async def precompile(self, params: SamplingParams) -> None:
        """Compile a request's structured outputs constraint in a worker thread (ValueError when it is invalid):
        the engine thread then finds it in the compiler's cache instead of stalling the batch on it."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.structured.compile, params.structured_outputs)

    def open_stream(self) -> OutputStream:
        self.start()
        return OutputStream(self)

    async def generate(self, prompt: str | Seq[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """One request's outputs, one per engine step that advanced it (cumulative; a caller far behind the
        engine gets fewer: OutputStream); aborts it if the caller goes away."""
        stream = self.open_stream()
        try:
            await stream.add(request_id, prompt, params)
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread, between steps; its result (or exception) in the future. For
        code on other threads that must touch the engine (the KV transfer threads of disaggregation)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, done))
        return done

    def abort_all(self, refuse_new: bool = False) -> None:
        """Abort every request in flight; each stream still ends with its final (finish_reason "abort") output.
        ``refuse_new``: requests added after it fail with EngineDeadError (a server shutting down: a beam search's
        next step, a request on a kept-alive connection, find the engine closed rather than run on)."""
        with self._cond:
            self._draining = self._draining or refuse_new
        self._submit(("abort_all",))

    def _submit(self, command: tuple) -> None:
        with self._cond:
            if self._stopping or (self._thread is not None and not self._thread.is_alive()):
                if command[0] in ("add", "call"):
                    _fail(command[-1], EngineDeadError("the engine is shutting down"))
                return
            if self._draining and command[0] == "add":
                _fail(command[-1], EngineDeadError("the server is shutting down"))
                return
            self._commands.append(command)
            self._cond.notify()

    # ---- the loop thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                stats_due = False
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        if self._wait_idle(engine):
                            stats_due = True
                            break
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                if stats_due:  # logged outside the lock: a slow log handler never holds up a request's submit
                    engine.stat_logger.maybe_log(engine.stats, force=True)
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                if engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # the loop itself broke: fail everyone rather than hang them
            logger.exception("engine loop stopped")
            self.error = e
        finally:
            with self._cond:
                self._stopping = True
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] in ("add", "call"):
                    _fail(command[-1], EngineDeadError("the engine is shutting down"))
            for request_id in list(self._streams):
                self._abort(request_id)

    def _wait_idle(self, engine: LLMEngine) -> bool:
        """Wait for work (holding ``_cond``); True when, instead, the stats line covering the last tokens fell due
        (the caller logs it then, not when the next request comes). With everything logged, the next line's rates
        count from the next wake."""
        due = engine.stat_logger.due_in(engine.stats)
        if due is None:
            self._cond.wait()
            engine.stat_logger.restart()
            return False
        return not self._cond.wait(min(due, threading.TIMEOUT_MAX))

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self._abort(command[1])
            return
        if command[0] == "abort_all":
            for request_id in list(self._streams):
                self._abort(request_id)
            return
        if command[0] == "fail":  # a tensor-parallel worker died (WorkerPool.on_failure): no step can run again
            self._fail_streams(command[1])
            raise command[1]
        if command[0] == "call":
            _, fn, done = command
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    done.set_exception(e)
            return
        _, request_ids, add, emit, stream, done = command
        if not done.set_running_or_notify_cancel():  # the caller gave up before the engine got to it
            return
        try:
            result = add(self.engine)
        except Exception as e:  # ValueError: bad input; the engine changed nothing
            done.set_exception(e)
            return
        for request_id in request_ids:
            self._streams[request_id] = stream
        if emit:
            (request_id,) = request_ids
            out = self.engine.output(request_id)
            if out.finished:
                self._streams.pop(request_id, None)
            self._run_hooks([out])
            stream._put(out)
        done.set_result(result)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if out is not None:
            self._run_hooks([out])
            if stream is not None:
                stream._put(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
            self._fail_streams(e)
            if isinstance(e, WorkerFailure):  # a tensor-parallel rank is gone: no step can run again, so the loop
                raise                         # stops (is_running turns False; /health says 503)
            return
        self._run_hooks(outputs)  # first: a client that has its reply finds it counted in /metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                stream._put(out)

    def _fail_streams(self, error: BaseException) -> None:
        """Every request in flight ends in an error (its stream raises EngineDeadError) and is aborted."""
        for request_id, stream in list(self._streams.items()):
            stream._put(EngineDeadError(f"engine step failed: {error}"))
            self._abort(request_id)

    def _run_hooks(self, outputs: list[RequestOutput]) -> None:
        for hook in self.output_hooks:
            try:
                hook(outputs)
            except Exception:
                logger.exception("output hook failed")


def _fail(done: concurrent.futures.Future, error: BaseException) -> None:
    """Fail an add whose caller may have cancelled it meanwhile (a cancelled future takes no result)."""
    if done.set_running_or_notify_cancel():
        done.set_exception(error)
