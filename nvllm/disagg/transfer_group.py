"""The KV transfer group: one torch.distributed process group over every prefill and decode worker of a
deployment (gloo between CPUs, NCCL between GPUs), joined at start-up through a TCPStore at --kv-master.

The group is built standalone (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a prefixed store), not as the
default process group, so it never collides with a process group the worker uses for anything else.

At the rendezvous every worker publishes its role, its KV layout and its HTTP address in the store and reads
everyone else's: workers whose KV pools differ (another model, dtype, block size, KV cache type) stop there
with one clear error rather than exchanging bytes that would mean nothing to each other.

One transfer is one uint8 message sent with the tag the receiver chose: a header — int64 [tag, status, payload
bytes] — then the payload, whose size both sides agreed on beforehand (a failed sender still sends that many bytes,
with the failed status, so the receiver is told rather than left waiting). One message means one receive and one
wake-up of the receiving thread per transfer. Each transfer thread reuses one ``MessageBuffer``: no allocation per
transfer. Gloo matches messages by (peer, tag), so a transfer abandoned halfway can never be mistaken for a later
one; NCCL matches by order per peer pair, which the callers keep by running every transfer of a worker on one
thread, and the receiver still checks the tag it gets back.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading

import torch
import torch.distributed as dist

from nvllm.config import ConfigError, first_line

logger = logging.getLogger("nvllm")

STATUS_OK, STATUS_FAILED = 1, 0
HEADER_BYTES = 24  # int64 [tag, status, payload bytes]


class TransferError(RuntimeError):
    """A transfer did not complete: the peer died, refused, timed out, or answered out of order."""


class TransferGroup:
    def __init__(self, rank: int, world_size: int, master: tuple[str, int], backend: str, device: torch.device,
                 info: dict, transfer_timeout: float, join_timeout: float = 900.0, store_external: bool = False):
        """Join the group (blocks until every worker has joined, at most join_timeout seconds). info: what
        this worker tells the others (role, layout signature, url, …); peers[r] is rank r's. The store at
        ``master`` is rank 0's, unless ``store_external`` (another process serves it; every rank connects)."""
        self.rank, self.backend = rank, backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=transfer_timeout)
        logger.info("joining the KV transfer group at %s:%d as rank %d of %d (it waits for every rank)", *master,
                    rank, world_size)
        store = _off_the_main_thread(lambda: self._rendezvous(rank, world_size, master, info, join_timeout,
                                                             store_external))
        mine = info["layout"]
        other = next((r for r, p in self.peers.items() if p["layout"] != mine), None)
        if other is not None:
            raise ConfigError(f"KV transfer group: rank {other}'s KV cache layout differs from this worker's "
                              f"(rank {rank}): {self.peers[other]['layout']} vs {mine}; every worker must serve the "
                              "same model with the same dtype, block size and KV cache type")
        other = next((r for r, p in self.peers.items() if "weights" not in p), None)
        if other is not None:
            raise ConfigError(f"KV transfer group: rank {other} sent no weights fingerprint (an older nvllm?): every "
                              "worker of a deployment must run the same nvllm")
        other = next((r for r, p in self.peers.items() if p["weights"] != info["weights"]), None)
        if other is not None:
            raise ConfigError(f"KV transfer group: rank {other} serves other weights than this worker (rank {rank}; "
                              f"weights fingerprint {self.peers[other]['weights']} vs {info['weights']}): "
                              "one model's KV is wrong for another, even of the same shapes (a base model and its "
                              "fine-tune); every worker must serve the same checkpoint")
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            opts.is_high_priority_stream = True  # transfers go ahead of the engine's kernels (see transfer_thread)
            opts.global_ranks_in_group = list(range(world_size))
            opts.group_name = "nvllm_kv"
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self._store), rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self._store), rank, world_size, self.timeout)
        self._store_ref = store  # the store (rank 0's, or the connection to it) lives as long as the group
        logger.info("joined the KV transfer group: rank %d of %d (%s), %s", rank, world_size, backend,
                    ", ".join(f"{r}={p['role']}" for r, p in sorted(self.peers.items())))

    def _rendezvous(self, rank: int, world_size: int, master: tuple[str, int], info: dict, join_timeout: float,
                    store_external: bool):
        """Connect to the store, publish this worker's info and read everyone's (blocks until every rank has);
        returns the store."""
        host, port = master
        serves = rank == 0 and not store_external
        try:
            store = dist.TCPStore(host, port, world_size, is_master=serves,
                                  timeout=datetime.timedelta(seconds=join_timeout), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - a taken port, an unreachable master: one line
            raise ConfigError(f"cannot join the KV transfer group at {host}:{port} as rank {rank}: {e}") from None
        self._store = dist.PrefixStore("nvllm-kv", store)
        if self._store.check([f"info/{rank}"]):  # the group formed with another process as this rank
            raise ConfigError(f"KV transfer group at {host}:{port}: rank {rank} joined it before; a worker that "
                              "died cannot take its place in the group it formed with the others: restart the "
                              "deployment")
        try:
            self._store.set(f"info/{rank}", json.dumps(info))
            self.peers = {r: json.loads(self._store.get(f"info/{r}")) for r in range(world_size)}
            self._store.set(f"read/{rank}", "1")
            if serves:  # the store lives in this process: keep it up until everyone has read what it needs
                self._store.wait([f"read/{r}" for r in range(world_size)], datetime.timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - a rank that died or never came: one line
            raise ConfigError(f"KV transfer group at {host}:{port}: the rendezvous failed for rank {rank} "
                              f"({first_line(e)[:200]})") from None
        return store

    def ranks(self, role: str) -> list[int]:
        return [r for r, p in self.peers.items() if p["role"] == role]

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            raise TransferError(f"{what} rank {peer} failed: {first_line(e)[:200]}") from None

    def send(self, dst: int, tag: int, message: torch.Tensor, ok: bool = True) -> None:
        """Send one message (from ``MessageBuffer.get``, its payload in place; ``ok`` False: the sender could not
        fill it, and the receiver is told). Returns once the bytes have left."""
        header = torch.tensor([tag, STATUS_OK if ok else STATUS_FAILED, message.numel() - HEADER_BYTES],
                              dtype=torch.int64)
        message[:HEADER_BYTES].view(torch.int64).copy_(header)
        self._wait(self.pg.send([message], dst, tag), "sending KV to", dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def recv(self, src: int, tag: int, message: torch.Tensor) -> torch.Tensor:
        """Receive one message into ``message`` (``MessageBuffer.get`` of the payload size agreed on); returns
        the payload, a view of it. TransferError when it failed on the sender's side."""
        self._wait(self.pg.recv([message], src, tag), "receiving KV from", src)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        got_tag, status, size = message[:HEADER_BYTES].view(torch.int64).tolist()
        if got_tag != tag:
            raise TransferError(f"rank {src} answered transfer {got_tag} where {tag} was expected (out of order)")
        if status != STATUS_OK:
            raise TransferError(f"rank {src} could not send the KV of transfer {tag}")
        if size != message.numel() - HEADER_BYTES:
            raise TransferError(f"rank {src} sent {size} bytes where {message.numel() - HEADER_BYTES} were expected")
        return message[HEADER_BYTES:]


class MessageBuffer:
    """A transfer thread's reusable message buffer on the group's device, grown (never shrunk) to the largest
    transfer seen. Transfers on one thread run one at a time and ``send``/``recv`` return once the bytes have moved,
    so the next transfer may reuse it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buf: torch.Tensor | None = None

    def get(self, payload_bytes: int) -> torch.Tensor:
        """A uint8 view of ``HEADER_BYTES + payload_bytes`` (the payload starts 8-byte aligned)."""
        need = HEADER_BYTES + payload_bytes
        if self._buf is None or self._buf.numel() < need:
            self._buf = None  # the old one goes first
            size = -(-need // (1 << 20)) << 20  # whole MiB
            self._buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buf[:need]


def _off_the_main_thread(join):
    """Run the rendezvous on a thread of its own: the store's calls block in C++, where SIGINT/SIGTERM handlers
    cannot run, and a worker waiting for ranks that never come must still stop on a signal. A line every 30 s says
    it is still waiting."""
    box: dict = {}

    def run() -> None:
        try:
            box["store"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="nvllm-kv-join", daemon=True)
    thread.start()
    waited = 0
    while thread.is_alive():
        thread.join(30)
        if thread.is_alive():
            waited += 30
            logger.info("still waiting for the other ranks of the KV transfer group (%d s)", waited)
    if "error" in box:
        raise box["error"]
    return box["store"]
