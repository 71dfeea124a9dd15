"""What a caller of the async engine holds: the requests of one API call (EngineRequest) and the stream of their
outputs (OutputStream), which the engine's loop thread fills through ``loop.call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
import uuid
from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING, Any, NamedTuple

from nvllm.engine.kv_handoff import KVTarget
from nvllm.engine.llm_engine import LLMEngine
from nvllm.engine.sequence import PrefilledSample
from nvllm.lora.request import LoRARequest
from nvllm.outputs import RequestOutput
from nvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvllm.engine.async_engine import AsyncLLMEngine


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
