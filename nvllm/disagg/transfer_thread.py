"""The thread a worker runs its KV transfers on, one at a time, in the order they were queued.

Request handlers queue jobs (``submit``); ``stop`` queues the end. On a GPU the thread works on a CUDA stream
of its own at the highest priority, so staging copies do not wait behind the engine's kernels. Subclasses say what one job is
(``handle``) and, with ``idle_timeout``, what to do when no job came for that long (``on_idle``)."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod

import torch

from nvllm.disagg.metrics import TransferLogger
from nvllm.disagg.staging import KVLayout


class TransferThread(ABC):
    idle_timeout: float | None = None  # seconds without a job before on_idle() runs; None: wait forever

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

    def on_idle(self) -> None:
        pass

    def _run(self) -> None:
        stream = None
        if self.layout.device.type == "cuda":
            torch.cuda.set_device(self.layout.device)
            # the highest priority: the staging copies' blocks go ahead of the engine's queued kernels instead of
            # waiting for a busy GPU (one 2000-token transfer took 45-70 ms at normal priority, PERF run Y)
            stream = torch.cuda.Stream(self.layout.device, priority=-100)  # clamped to the highest the GPU has
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_timeout)
            except queue.Empty:
                self.on_idle()
                continue
            if job is None:
                return
            self.handle(job, stream)
            self.log.maybe_log()
