"""The thread a worker runs its KV transfers on, one at a time, in the order they were queued.

Request handlers queue jobs (``submit``); ``stop`` queues the end. On a GPU the thread works on a CUDA stream of its
own at the highest priority, so staging copies do not wait behind the engine's kernels. Subclasses say what one job
is (``handle``) and, with ``interval``, what to do between jobs that often, busy or not (``periodic``)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod

import torch

from nvllm.disagg.metrics import TransferLogger
from nvllm.disagg.staging import KVLayout


logger = logging.getLogger("nvllm")
_NO_JOB = object()


class TransferThread(ABC):
    interval: float | None = None  # seconds between periodic() calls, whether jobs come or not; None: never

    def __init__(self, layout: KVLayout, log: TransferLogger, name: str):
        """Call last in the subclass's __init__: the thread starts at once."""
        self.layout, self.log = layout, log
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    @abstractmethod
    def handle(self, job, stream: torch.cuda.Stream | None) -> None:
        """Run one job on this thread (``stream``: the thread's CUDA stream, None on the CPU)."""

    def periodic(self) -> None:
        """Runs between jobs every ``interval`` seconds."""

    def _run(self) -> None:
        stream = None
        if self.layout.device.type == "cuda":
            torch.cuda.set_device(self.layout.device)
            # the highest priority: the staging copies' blocks go ahead of the engine's queued kernels instead of
            # waiting for a busy GPU (one 2000-token transfer took 45-70 ms at normal priority, PERF run Y)
            stream = torch.cuda.Stream(self.layout.device, priority=-100)  # clamped to the highest the GPU has
        due = None if self.interval is None else time.monotonic() + self.interval
        while True:
            try:
                job = self._jobs.get(timeout=None if due is None else max(due - time.monotonic(), 0.0))
            except queue.Empty:
                job = _NO_JOB
            if due is not None and time.monotonic() >= due:  # also under a steady stream of jobs
                self.periodic()
                due = time.monotonic() + self.interval
            if job is _NO_JOB:
                continue
            if job is None:
                return
            try:
                self.handle(job, stream)
            except Exception:  # noqa: BLE001 - one job's failure never ends the thread: later jobs, and the
                logger.exception("a KV transfer job failed")  # periodic expiry of held KV, still need it
            self.log.maybe_log()
