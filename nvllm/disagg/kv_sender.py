"""The prefill worker's transfer thread: sends held KV to decode workers, one transfer at a time.

A decode worker asks for a handle (POST /internal/kv/send); the request handler takes the block ids from the
engine (export_kv, so the blocks can no longer expire) and queues a job here. The thread copies the blocks
into its message buffer, hands the blocks back to the engine at once (the copy holds the bytes), and sends
the message (header and blocks) to the decode worker's rank. All sends of this worker run on this one thread,
in the order they were asked for, so every (this worker, decode worker) pair sees its transfers in one order.

Between jobs it expires handles no decode worker asked for within --kv-handle-timeout.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from nvllm.disagg.metrics import SEND_PHASES, TransferLogger, TransferStats
from nvllm.disagg.staging import KVLayout
from nvllm.disagg.transfer_group import HEADER_BYTES, MessageBuffer, TransferError, TransferGroup
from nvllm.disagg.transfer_thread import TransferThread
from nvllm.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("nvllm")


@dataclass
class SendJob:
    handle: str
    block_ids: list[int]
    dst: int
    tag: int
    queued_at: float = field(default_factory=time.perf_counter)


class KVSender(TransferThread):
    interval = 1.0  # handles are expired between jobs, once a second

    def __init__(self, engine: AsyncLLMEngine, group: TransferGroup, layout: KVLayout, stats: TransferStats,
                 handle_timeout: float, log_interval: float):
        self.engine, self.group, self.stats = engine, group, stats
        self.handle_timeout = handle_timeout
        self.buffer = MessageBuffer(group.device)
        super().__init__(layout, TransferLogger(stats, "prefill", log_interval), "nvllm-kv-sender")

    def periodic(self) -> None:
        self._expire()

    def handle(self, job: SendJob, stream) -> None:
        t0 = time.perf_counter()
        marks = [job.queued_at, t0]  # the end of each phase: queue, gather, send
        message = self.buffer.get(self.layout.nbytes(len(job.block_ids)))
        ok = False
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if message.device == self.layout.device:
                    self.layout.gather(job.block_ids, out=message[HEADER_BYTES:])
                else:  # GPU pool, gloo group: through host memory
                    message[HEADER_BYTES:].copy_(self.layout.gather(job.block_ids))
            if stream is not None:
                stream.synchronize()
            ok = True
        except Exception:  # noqa: BLE001 - the receiver is told; the engine goes on
            logger.exception("gathering the KV of %s failed", job.handle)
        finally:
            self.engine.call(lambda e: e.release_kv(job.handle))  # the message holds the bytes now
        marks.append(time.perf_counter())
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.group.send(job.dst, job.tag, message, ok)
        except TransferError as e:
            logger.warning("KV transfer of %s to rank %d failed: %s", job.handle, job.dst, e)
            self.stats.transfer(False)
            return
        if not ok:
            self.stats.transfer(False)
        else:
            marks.append(time.perf_counter())
            phases = dict(zip(SEND_PHASES, (b - a for a, b in zip(marks, marks[1:]))))
            self.stats.transfer(True, message.numel() - HEADER_BYTES, marks[-1] - t0, phases)

    def _expire(self) -> None:
        try:
            n = self.engine.call(lambda e: e.handoff.expire(self.handle_timeout)).result()
        except Exception:  # noqa: BLE001 - the engine is shutting down
            return
        if n:
            self.stats.add("expired", n)
            logger.warning("released the KV of %d prefilled sequences no decode worker fetched within %.0f s",
                           n, self.handle_timeout)

