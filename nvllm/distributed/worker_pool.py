"""WorkerPool: rank 0's handle on the tensor-parallel worker processes.

Start: a TCPStore on a free localhost port (the OS picks it), one process per extra rank (spawn context,
daemonic), a wait until each has reached the store (a worker that dies first ends the wait with its error),
then the group's rendezvous. Rank r runs on cuda:(first + r) where cuda:first is the engine's device.

Failure: a watcher thread waits on the workers' process sentinels. When one ends while the engine runs, the
pool records why — the exception the worker sent (re-raised on rank 0 as that very exception) or how the process
died (exit code, signal) —, aborts the compute group, so that a collective in flight fails instead of waiting,
and tells ``on_failure``'s callbacks (a server's loop stops then, idle or not). Every step runs inside
``guard()``: it raises the recorded failure before a step, and when a step fails it raises the root cause (a
WorkerFailure) and stops the workers (a step interrupted half-way leaves the ranks out of step for good).

Stop (``stop()``: engine teardown, garbage collection or interpreter exit through the runner's finalizer): an
empty message ends the workers' loops; a worker not gone within seconds is killed (workers ignore SIGINT and
SIGTERM: rank 0 decides when they stop, see ``nvllm.distributed.worker``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
import signal
import threading
import time
from collections.abc import Callable

import torch

from nvllm.distributed.group import STORE_TIMEOUT, TPGroup, local_store
from nvllm.engine.step_inputs import SHUTDOWN

logger = logging.getLogger("nvllm")
_CAUSE_GRACE_S = 2.0  # after a failed collective: how long to wait for the watcher to name a dead worker


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or the group broke; the engine cannot run further steps."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` when rank 0 runs on ``device``: the next GPUs in order, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class WorkerPool:
    def __init__(self, config, device: torch.device):
        import multiprocessing as mp

        from nvllm.distributed.worker import worker_main

        self.size = config.tensor_parallel_size
        self.failure: BaseException | None = None
        self.on_failure: list[Callable[[BaseException], None]] = []  # called (from the watcher) once a failure is known
        self.group: TPGroup | None = None
        self.lock = threading.RLock()  # held by each step; stop() waits for the step in flight
        self._fail_lock = threading.Lock()
        self._stopped = False
        self.procs, self.conns = [], []
        self.store = local_store(self.size, STORE_TIMEOUT)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, self.size):
                worker_config = copy.copy(config)  # not dataclasses.replace: rank 0 validated it for its device
                worker_config.device, worker_config.speculative = str(rank_device(device, rank)), None
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, name=f"nvllm-tp-rank{rank}", daemon=True,
                                   args=(rank, self.size, self.store.port, worker_config, send,
                                         torch.get_num_threads()))
                proc.start()
                send.close()
                self.procs.append(proc)
                self.conns.append(recv)
            threading.Thread(target=self._watch, name="nvllm-tp-watch", daemon=True).start()
            self._await_workers()
            self.group = TPGroup.connect(0, self.size, self.store, device)
        except BaseException:
            self.stop()
            raise
        logger.info("tensor parallel: %d ranks (%s), worker pids %s", self.size, self.group.backend,
                    [p.pid for p in self.procs])

    # ---- failure detection ----------------------------------------------------------------------------------
    def _await_workers(self) -> None:
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        keys = [f"ready/{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            if self.failure is not None:
                raise self.failure
            if time.monotonic() > deadline:
                raise WorkerFailure(f"tensor-parallel workers did not start within "
                                    f"{STORE_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.02)

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while not self._stopped:
            ended = wait(list(sentinels), timeout=0.5)
            if ended and not self._stopped:
                time.sleep(0.1)  # a worker that failed because another died: name the one that died first
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                killed = [i for i in dead if (self.procs[i].exitcode or 0) < 0]
                self._fail(self._worker_error((killed or dead or [sentinels[ended[0]]])[0]))
                return

    def _worker_error(self, i: int) -> BaseException:
        proc, conn, rank = self.procs[i], self.conns[i], i + 1
        proc.join(1.0)
        with contextlib.suppress(EOFError, OSError):
            if conn.poll(0.5):
                payload, text = conn.recv()
                logger.error("%s", text.rstrip())
                if payload is not None:
                    with contextlib.suppress(Exception):
                        return pickle.loads(payload)
                return WorkerFailure(f"tensor-parallel worker rank {rank} failed: {text.strip().splitlines()[-1]}")
        code = proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        return WorkerFailure(f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}; the engine has stopped")

    def _fail(self, error: BaseException) -> None:
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = error
        logger.error("tensor parallel: %s", error)
        if self.group is not None:
            self.group.abort()
        for callback in self.on_failure:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one listener's failure must not hide the others'
                logger.exception("tensor parallel: a failure callback failed")

    def check(self) -> None:
        """Raise the recorded failure (stopping the surviving workers), or WorkerFailure when the pool was
        stopped."""
        if self.failure is not None:
            self.stop()
            raise self.failure
        if self._stopped:
            raise WorkerFailure("the tensor-parallel workers were shut down")

    @contextlib.contextmanager
    def guard(self):
        """Run one collective piece of work (a step) with the workers: the failure of a worker surfaces as
        its own error; any failure stops the pool."""
        with self.lock:
            self.check()
            try:
                yield
            except Exception as e:
                deadline = time.monotonic() + _CAUSE_GRACE_S
                while self.failure is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                cause = self.failure
                if cause is None:
                    cause = WorkerFailure(f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); "
                                          "the workers were stopped")
                    self._fail(cause)
                self.stop()
                if cause is e:
                    raise
                raise cause from e
            except BaseException:  # Ctrl-C or an exit while a step ran: no failure of the group, but the workers are
                self.stop(clean=False)  # mid-collective: no shutdown message would reach them; they are killed
                raise

    # ---- stop -------------------------------------------------------------------------------------------
    def stop(self, clean: bool = True) -> None:
        """End the workers (cleanly when the group is healthy and ``clean``: no step was cut short) and release the
        group. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        locked = self.lock.acquire(timeout=10)
        try:
            clean = clean and self.failure is None and self.group is not None and all(p.is_alive() for p in self.procs)
            if clean:
                try:
                    self.group.broadcast_message(SHUTDOWN)
                except Exception:
                    clean = False
            for p in self.procs:
                p.join(5.0 if clean else 0.2)
            for p in self.procs:
                if p.is_alive():  # (SIGTERM would do nothing: workers ignore it)
                    p.kill()
                    p.join(2.0)
        finally:
            if locked:
                self.lock.release()
            if self.group is not None:
                self.group.close()
            for c in self.conns:
                c.close()
            self.store = None
