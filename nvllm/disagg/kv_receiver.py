"""The decode worker's transfer thread: fetches the prompt KV of prefilled requests, one transfer at a time.

For each sequence waiting for its KV (the engine gave it blocks when the request was registered, sharing what
its prefix cache already held, so only the missing blocks travel): the thread asks the prefill worker over
HTTP to send the handle's remaining blocks to this rank with a fresh tag (control data only), receives the
message (header and blocks) over the transfer group into its reusable buffer, scatters it into the blocks
(after the engine's queued steps), and hands the sequence to the scheduler. Any failure — the prefill worker
gone, the handle expired, a broken transfer — is not the request's end: its prompt is recomputed here instead,
and the request goes on. All receives of this worker run on this one thread, in the order they were asked for,
which keeps every (prefill worker, this worker) pair in one order.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import httpx
import torch

from nvllm.disagg.handoff import ReleaseCall, SendAccepted, SendCall
from nvllm.disagg.metrics import PHASES, TransferLogger, TransferStats
from nvllm.disagg.staging import KVLayout
from nvllm.disagg.transfer_group import MessageBuffer, TransferError, TransferGroup
from nvllm.disagg.transfer_thread import TransferThread
from nvllm.engine.async_engine import AsyncLLMEngine
from nvllm.engine.kv_handoff import KVTarget

logger = logging.getLogger("nvllm")


@dataclass
class ReceiveJob:
    target: KVTarget
    prefill_url: str
    prefill_rank: int
    handle: str | None  # None: nothing held on the prefill side (recompute here)

    @property
    def seq(self):
        return self.target.seq


class KVReceiver(TransferThread):
    def __init__(self, engine: AsyncLLMEngine, group: TransferGroup, layout: KVLayout, stats: TransferStats,
                 api_key: str | None, transfer_timeout: float, log_interval: float):
        self.engine, self.group, self.stats = engine, group, stats
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(transfer_timeout, connect=5.0))
        self._tags = itertools.count(1)
        self.buffer = MessageBuffer(group.device)
        super().__init__(layout, TransferLogger(stats, "decode", log_interval), "nvllm-kv-receiver")

    def handle(self, job: ReceiveJob, stream) -> None:
        try:
            self._receive(job, stream)
        except Exception:  # noqa: BLE001 - never leave a sequence stranded
            logger.exception("receiving the KV of %s failed", job.handle)
            self._arrived(job, False)

    def _receive(self, job: ReceiveJob, stream) -> None:
        t0 = time.perf_counter()
        skip, block_ids = job.target.skip_blocks, job.target.block_ids
        if block_ids is None:  # no room here: the engine queued the prompt to be recomputed
            self.stats.add("recomputed")
            self._release(job)
            return
        if job.handle is None or job.seq.finished:  # nothing held to fetch, or aborted meanwhile
            self._release(job)
            self._arrived(job, False)
            return
        if not block_ids:  # the whole prompt was in this worker's prefix cache
            self._release(job)
            self._arrived(job, True)
            return
        tag = next(self._tags) % (1 << 31)
        nbytes = self.layout.nbytes(len(block_ids))
        ok = False
        marks = [t0]  # the end of each phase: ask, wire, copy
        try:
            r = self._http.post(f"{job.prefill_url}/internal/kv/send", json=SendCall(
                handle=job.handle, dst_rank=self.group.rank, tag=tag, skip_blocks=skip).model_dump())
            if r.status_code != 200:
                raise TransferError(f"the prefill worker answered {r.status_code}: {r.text[:200]}")
            if SendAccepted.model_validate(r.json()).nbytes != nbytes:
                raise TransferError("the prefill worker's KV layout does not match this worker's")
            marks.append(time.perf_counter())
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                staging = self.group.recv(job.prefill_rank, tag, self.buffer.get(nbytes))  # once the bytes are here
                marks.append(time.perf_counter())
                if stream is not None:
                    # with asynchronous scheduling a step already queued on the engine's (default) stream may still
                    # write a block that was freed under it and is now this sequence's: write after those steps
                    stream.wait_stream(torch.cuda.default_stream(self.layout.device))
                self.layout.scatter(block_ids, staging)
            if stream is not None:
                stream.synchronize()
            marks.append(time.perf_counter())
            ok = True
        except (httpx.HTTPError, TransferError, ValueError) as e:
            logger.warning("KV of %s not received from rank %d (%s); its prompt is recomputed here if the request "
                           "is still running", job.handle, job.prefill_rank, e)
        phases = dict(zip(PHASES, (b - a for a, b in zip(marks, marks[1:])))) if ok else None
        self.stats.transfer(ok, nbytes, time.perf_counter() - t0, phases)
        self._arrived(job, ok)

    def _arrived(self, job: ReceiveJob, ok: bool) -> None:
        if ok:
            self.stats.kv_arrived(job.seq.request_id)
        elif not job.seq.finished:
            self.stats.add("recomputed")
        self.engine.call(lambda e: e.handoff.arrived(job.seq, ok))

    def _release(self, job: ReceiveJob) -> None:
        """Tell the prefill worker its held blocks will not be fetched (best effort: they expire anyway)."""
        if job.handle is None:
            return
        try:
            self._http.post(f"{job.prefill_url}/internal/kv/release",
                            json=ReleaseCall(handles=[job.handle]).model_dump(), timeout=5.0)
        except httpx.HTTPError:
            pass
