"""AsyncLLMEngine: the engine's step loop on a background thread, beside an asyncio event loop.

The engine is not thread-safe, so only the loop thread touches it: adds and aborts travel to it through a
command list it drains before every step. Each caller reads an `OutputStream`, which the loop thread fills
through `loop.call_soon_threadsafe` (a reader far behind gets a request's later steps merged); one stream may
carry several requests (the n prompts of one HTTP call). A stream closed before its requests finish (client
gone, task cancelled) aborts them, which frees their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from typing import Any

from nvllm.distributed.worker_pool import WorkerFailure
from nvllm.engine.llm_engine import LLMEngine
from nvllm.engine.output_stream import EngineDeadError, OutputStream
from nvllm.outputs import RequestOutput
from nvllm.sampling_params import SamplingParams

logger = logging.getLogger("nvllm")

OutputHook = Callable[[list[RequestOutput]], None]


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
