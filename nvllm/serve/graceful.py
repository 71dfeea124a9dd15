"""uvicorn as nvllm's servers run it: idle connections kept past the clients' own keep-alive, a graceful shutdown
that ends every stream properly, and an exit status of 0 after SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import uvicorn

from nvllm.config import first_line
from nvllm.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("nvllm")

# An idle connection stays open this long. httpx (so the openai client) drops its idle connections after 5 s, the
# same as uvicorn's default: with equal timeouts a client can send on a connection the server is closing, and a
# request with no retries fails with a read error. Longer here, the client always lets go first.
KEEP_ALIVE_S = 15
FLUSH_S = 5  # after the abort, time for the final chunks to reach the clients before uvicorn cancels


class GracefulServer(uvicorn.Server):
    """uvicorn's shutdown (stop accepting, wait for in-flight requests) with one step added: after `grace`
    seconds the engine aborts what is still running, so every stream still ends properly (a last chunk with
    finish_reason "abort", then [DONE]) instead of being cut off.

    A server whose engine loop died (a tensor-parallel rank gone) cannot answer again: it shuts down and the
    process exits 1, for a supervisor to restart it, as vLLM's does. ``NVLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` keeps
    it up instead, answering 503 (/health too)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.keep_alive = os.environ.get("NVLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0") not in ("", "0")
        self.engine_died = False
        self.abort_requested = False  # SIGUSR1 (abort_on_sigusr1): abort what is in flight at the next tick

    async def on_tick(self, counter: int) -> bool:
        if self.abort_requested:
            self.abort_requested = False
            self._abort_in_flight()
        error = self.engine.error
        if error is not None and not self.engine_died and not self.keep_alive:
            self.engine_died = True
            logger.error("the engine stopped (%s): shutting the server down (NVLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 "
                         "keeps it up, answering 503)", first_line(error))
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_in_flight(self) -> None:
        logger.warning("shutdown: aborting the requests still in flight")
        self.engine.abort_all(refuse_new=True)


@contextlib.contextmanager
def abort_on_sigusr1(server: GracefulServer):
    """SIGUSR1 aborts every request in flight (each stream ends with its last chunk, then [DONE]) and refuses new
    ones: what the --disaggregate launcher sends its workers once its router's --shutdown-timeout has passed. (The
    handler only sets a flag; the server's loop acts on it.)"""
    if not hasattr(signal, "SIGUSR1"):
        yield
        return
    previous = signal.signal(signal.SIGUSR1, lambda *_: setattr(server, "abort_requested", True))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@contextlib.contextmanager
def exit_quietly_after_signals():
    """uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the handler it found;
    a no-op handler there lets a graceful shutdown end with exit status 0 instead of death by signal. SIGHUP (the
    terminal closed) is passed on as SIGTERM, so it shuts the server down the same way."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    if hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: signal.raise_signal(signal.SIGTERM))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
