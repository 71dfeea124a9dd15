"""The router's view of its workers: who is up, how loaded, and what they report.

Every `poll_interval` seconds the router asks each prefill / decode worker for /internal/info (role, queue
lengths, KV usage, transfer counters) and each mixed worker for /health. A worker that does not answer, or
fails a request, is marked down and gets no new requests until a poll finds it answering again. The load of a
worker is the router's own count of requests in flight on it plus the queue it last reported; `pick` returns
the least loaded worker of a role that is up (ties go round-robin)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import httpx

from nvllm.config import first_line

logger = logging.getLogger("nvllm")


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode" | "mixed"
    up: bool = False
    in_flight: int = 0
    failures: int = 0
    info: dict = field(default_factory=dict)  # its last /internal/info
    problem: str = ""  # why it is down (for /router/workers and the log)

    @property
    def load(self) -> int:
        return self.in_flight + int(self.info.get("waiting", 0))

    def public(self) -> dict:
        return {"url": self.url, "role": self.role, "up": self.up, "in_flight": self.in_flight,
                "failures": self.failures, "problem": self.problem or None, "info": self.info or None}


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], mixed: list[str], client: httpx.AsyncClient,
                 api_key: str | None = None):
        """api_key: sent with the polls (the workers of a deployment share the router's key)."""
        self.workers = [Worker(u, "prefill") for u in prefill] + [Worker(u, "decode") for u in decode] + \
            [Worker(u, "mixed") for u in mixed]
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.queue_seconds: dict[tuple[str, str], float] = {}  # (role, waiting|running) → request-seconds
        self._turn = itertools.count()
        self._last_poll: float | None = None

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "mixed" for w in self.workers)

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def candidates(self, role: str) -> list[Worker]:
        """The workers of a role that are up, least loaded first (ties in round-robin order)."""
        up = [w for w in self.of(role) if w.up]
        if not up:
            return []
        shift = next(self._turn) % len(up)
        return sorted(up[shift:] + up[:shift], key=lambda w: w.load)

    def pick(self, role: str) -> Worker | None:
        c = self.candidates(role)
        return c[0] if c else None

    @contextlib.contextmanager
    def busy(self, worker: Worker):
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def failed(self, worker: Worker, error: str) -> None:
        worker.failures += 1
        if worker.up:
            logger.warning("%s worker %s failed (%s); no new requests go to it until it answers again",
                           worker.role, worker.url, error)
        worker.up, worker.problem = False, error

    # ---- polling -------------------------------------------------------------------------------------------
    async def poll_all(self) -> None:
        now = time.monotonic()
        if self._last_poll is not None:  # integrate the queues the workers reported over the interval
            dt = now - self._last_poll
            for w in self.workers:
                if w.up and w.info:
                    for state in ("waiting", "running"):
                        key = (w.role, state)
                        self.queue_seconds[key] = self.queue_seconds.get(key, 0.0) + w.info.get(state, 0) * dt
        self._last_poll = now
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: Worker) -> None:
        path = "/health" if w.role == "mixed" else "/internal/info"
        try:
            r = await self.client.get(w.url + path, headers=self.headers, timeout=2.0)
        except Exception as e:  # noqa: BLE001 - httpx's errors, and what the socket layer raises past them
            self._down(w, f"unreachable: {type(e).__name__} {first_line(e)[:160]}".rstrip())
            return
        if r.status_code != 200:
            self._down(w, f"{path} answered {r.status_code}")
            return
        if w.role != "mixed":
            try:
                info = r.json()
            except ValueError:
                self._down(w, f"{path} did not answer JSON")
                return
            if info.get("role") != w.role:
                self._down(w, f"it is a {info.get('role', 'non-disaggregated')} worker, not a {w.role} worker")
                return
            if not info.get("engine_running", True):
                self._down(w, "its engine is not running")
                return
            w.info = info
        if not w.up:
            logger.info("%s worker %s is up", w.role, w.url)
        w.up, w.problem = True, ""

    def _down(self, w: Worker, why: str) -> None:
        if w.up or w.problem != why:
            logger.warning("%s worker %s is down: %s", w.role, w.url, why)
        w.up, w.problem = False, why

    async def kernel_report(self) -> dict[str, dict[str, int]] | None:
        """The deployment's kernel report: each worker's {op: {impl: calls}} summed over the workers up that answer
        (a worker's counts are its own process's, so the sum is what the whole deployment ran); None when none
        does."""
        async def one(w: Worker) -> dict | None:
            try:
                r = await self.client.get(w.url + "/v1/kernel_report", headers=self.headers, timeout=5.0)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        reports = await asyncio.gather(*(one(w) for w in self.workers if w.up))
        total: dict[str, dict[str, int]] = {}
        for rep in (r for r in reports if isinstance(r, dict)):
            for op, impls in rep.items():
                for impl, n in (impls.items() if isinstance(impls, dict) else ()):
                    if isinstance(n, int):
                        total.setdefault(op, {})[impl] = total.get(op, {}).get(impl, 0) + n
        return total if any(isinstance(r, dict) for r in reports) else None
