"""TPGroup: one rank's view of the tensor-parallel group.

Two process groups join the ranks, both built directly on one TCPStore (no global default group, so one
process may hold several engines): the *compute* group carries the model's collectives (NCCL on GPUs, one
device per rank; gloo on the CPU) and the *control* group (gloo, CPU tensors) carries each step's inputs from
rank 0 and the start-up agreements. ``TPGroup.single()`` is the one-rank group: every collective is then a
no-op, so the layers call them unconditionally.

Failure: gloo raises as soon as a peer's connection closes; NCCL waits for its timeout unless the group is
aborted, which rank 0's worker watcher does when a worker dies (``abort``). NCCL's own error handling (unless
TORCH_NCCL_ASYNC_ERROR_HANDLING is set) aborts the communicators on rank 0 without ending the process — it is
the user's process, which reports the error — and ends a worker's process outright.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch

from nvllm.config import first_line
from nvllm.env_vars import env_number
from nvllm.kernels import report

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # workers wait here between steps, for as long as the engine idles
COMPUTE_TIMEOUT = datetime.timedelta(seconds=env_number("NVLLM_TP_TIMEOUT", 600.0, minimum=1.0))
STORE_TIMEOUT = datetime.timedelta(seconds=120)
ABORT_WAIT_S = 5.0


def local_store(world_size: int | None, timeout: datetime.timedelta):
    """A TCPStore served by this process for workers on this host: listening on loopback only (its own bind listens
    on every interface, an unauthenticated control port open to the network), on a port the OS picks."""
    import socket

    import torch.distributed as dist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    try:
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except (TypeError, RuntimeError, ValueError) as e:  # a torch without master_listen_fd for its backend
        sock.close()
        logger.warning("the workers' store listens on every interface (this torch refused a loopback socket: %s)",
                       first_line(e)[:160])
        return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
    sock.detach()  # the store serves on this socket from now on
    return store
"""How long ``abort`` waits for an NCCL communicator to be torn down before leaving it to the process's exit: on
the H200 machine, aborting one that CUDA graphs captured collectives on did not return (device run O)."""
logger = logging.getLogger("nvllm")
FIRST_WORDS = 1024  # a control message up to this long (any decode step of a modest batch) takes one round trip


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, control=None, compute=None, backend: str = "none", store=None):
        self.rank, self.size, self.backend = rank, size, backend
        self.control, self.compute, self.store = control, compute, store
        self.one_shot = None  # OneShotAllReduce once enable_one_shot() agreed on it
        self._first: torch.Tensor | None = None  # [length, first words of the message], reused by every broadcast

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @classmethod
    def connect(cls, rank: int, size: int, store, device: torch.device) -> "TPGroup":
        """Join the group (a rendezvous: returns once every rank has called it with the same store)."""
        import torch.distributed as dist

        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = COMPUTE_TIMEOUT
            opts.is_high_priority_stream = False
            opts.global_ranks_in_group = list(range(size))
            opts.group_name = "nvllm_tp"
            key, preset = "TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ[key] = preset or ("2" if rank == 0 else "3")  # 2: abort, keep the process; 3: end it
            try:  # read when the group is built
                compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, size, opts)
            finally:
                if preset is None:
                    del os.environ[key]
            backend = "nccl"
        else:
            compute = dist.ProcessGroupGloo(dist.PrefixStore("compute", store), rank, size, COMPUTE_TIMEOUT)
            backend = "gloo"
        return cls(rank, size, control, compute, backend, store)

    def enable_one_shot(self, dtype: torch.dtype, device: torch.device) -> None:
        """From now on, small all-reduces of ``dtype`` run one-shot over symmetric memory (nvllm.distributed.one_shot)
        where every rank could map its buffer. A collective: every rank calls it at the same point.
        NVLLM_ONE_SHOT_ALLREDUCE=0 keeps every all-reduce on NCCL."""
        if self.size == 1 or self.backend != "nccl" or os.environ.get("NVLLM_ONE_SHOT_ALLREDUCE") == "0":
            return
        import torch.distributed as dist

        from nvllm.distributed.one_shot import OneShotAllReduce

        try:  # the name must be the same on every rank and new in this process: the group's store port is both
            one = OneShotAllReduce(f"nvllm_tp_{self.store.port}", self.rank, self.size,
                                   dist.PrefixStore("one_shot", self.store), self.compute, dtype, device)
        except Exception as e:  # noqa: BLE001 - no symmetric memory here: NCCL does it all
            logger.warning("one-shot all-reduce unavailable (%s); all-reduces stay on NCCL", first_line(e)[:200])
            one = None
        if min(self.all_gather_int(int(one is not None))) == 1:
            self.one_shot = one
            logger.info("tensor parallel: all-reduces up to %d KiB one-shot over symmetric memory",
                        one.buffer.nbytes >> 10)
        elif one is not None:  # another rank could not map its buffer
            one.close()

    # ---- the model's collectives (compute group) --------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks. Returns the sum: ``t`` itself (NCCL, gloo: in place) or a new tensor (one-shot)."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.takes(t):
                report.record("all_reduce", "symm_mem one-shot")
                return self.one_shot(t)
            report.record("all_reduce", f"{self.backend} all_reduce")
            self.compute.allreduce([t]).wait()
        return t

    def gather_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape on all) in rank order on rank 0; None on the others."""
        if self.size == 1:
            return [t]
        import torch.distributed as dist

        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.compute.gather([parts], [t], opts).wait()
            return parts
        self.compute.gather([], [t], opts).wait()
        return None

    # ---- control messages (gloo, CPU) ---------------------------------------------------------------------
    def broadcast_message(self, message: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0 sends a 1-D int64 CPU tensor (``message``); every other rank returns it. One broadcast of a
        fixed size carries the length and the first FIRST_WORDS words; a longer message takes a second one."""
        if self._first is None:
            self._first = torch.empty(1 + FIRST_WORDS, dtype=torch.int64)
        first = self._first
        if self.rank == 0:
            n = message.numel()
            first[0] = n
            first[1:1 + min(n, FIRST_WORDS)] = message[:FIRST_WORDS]
        self.control.broadcast(first, 0).wait()
        n = int(first[0])
        if self.rank == 0:
            if n > FIRST_WORDS:
                self.control.broadcast(message[FIRST_WORDS:].contiguous(), 0).wait()
            return message
        head = first[1:1 + min(n, FIRST_WORDS)].clone()
        if n <= FIRST_WORDS:
            return head
        rest = torch.empty(n - FIRST_WORDS, dtype=torch.int64)
        self.control.broadcast(rest, 0).wait()
        return torch.cat([head, rest])

    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.control.allgather([out], [mine]).wait()
        return [int(t.item()) for t in out]

    # ---- teardown -----------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Make collectives in flight on the compute group fail now (NCCL: abort the communicator). Bounded: the
        abort runs on a daemon thread, given ``ABORT_WAIT_S`` seconds."""
        if self.backend == "nccl" and self.compute is not None:
            compute = self.compute

            def run() -> None:
                try:
                    compute.abort()
                except Exception:  # already torn down
                    pass

            t = threading.Thread(target=run, name="nvllm-nccl-abort", daemon=True)
            t.start()
            t.join(ABORT_WAIT_S)
            if t.is_alive():
                logger.warning("the NCCL communicator did not finish aborting in %.0f s; the process's exit ends it",
                               ABORT_WAIT_S)

    def close(self) -> None:
        """Drop the process groups. An NCCL communicator is aborted rather than destroyed: destroying one that
        CUDA graphs captured can wait forever."""
        self.abort()
        if self.one_shot is not None:
            self.one_shot.close()
        self.control = self.compute = self.one_shot = None
