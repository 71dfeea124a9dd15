"""The KV transfer group: one torch.distributed process group over every prefill and decode worker of a
deployment (gloo between CPUs, NCCL between GPUs), joined at start-up through a TCPStore at --kv-master.

The group is built standalone (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a prefixed store), not as the
default process group, so it never collides with a process group the worker uses for anything else.

At the rendezvous every worker publishes its role, its KV layout and its HTTP address in the store and reads
everyone else's: workers whose KV pools differ (another model, dtype, block size, KV cache type) stop there
with one clear error rather than exchanging bytes that would mean nothing to each other.

One transfer is a header — int64 [tag, status, bytes] — and, when the status is OK, one uint8 payload, both
sent with the tag the receiver chose. Gloo matches messages by (peer, tag), so a transfer abandoned halfway
can never be mistaken for a later one; NCCL matches by order per peer pair, which the callers keep by running
every transfer of a worker on one thread, and the receiver still checks the tag it gets back.
"""

from __future__ import annotations

import datetime
import json
import logging

import torch
import torch.distributed as dist

from nvllm.config import ConfigError

logger = logging.getLogger("nvllm")

STATUS_OK, STATUS_FAILED = 1, 0


class TransferError(RuntimeError):
    """A transfer did not complete: the peer died, refused, timed out, or answered out of order."""


class TransferGroup:
    def __init__(self, rank: int, world_size: int, master: tuple[str, int], backend: str, device: torch.device,
                 info: dict, transfer_timeout: float, join_timeout: float = 900.0):
        """Join the group (blocks until every worker has joined, at most join_timeout seconds). info: what
        this worker tells the others (role, layout signature, url, …); peers[r] is rank r's."""
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=transfer_timeout)
        host, port = master
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                  timeout=datetime.timedelta(seconds=join_timeout), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - a taken port, an unreachable master: one line
            raise ConfigError(f"cannot join the KV transfer group at {host}:{port} as rank {rank}: {e}") from None
        self._store = dist.PrefixStore("nvllm-kv", store)
        try:
            self._store.set(f"info/{rank}", json.dumps(info))
            self.peers = {r: json.loads(self._store.get(f"info/{r}")) for r in range(world_size)}
            self._store.set(f"read/{rank}", "1")
            if rank == 0:  # the store lives in this process: keep it up until everyone has read what it needs
                self._store.wait([f"read/{r}" for r in range(world_size)], datetime.timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - a rank that died or never came: one line
            raise ConfigError(f"KV transfer group at {host}:{port}: the rendezvous failed for rank {rank} "
                              f"({str(e).splitlines()[0][:200]})") from None
        mine = info["layout"]
        other = next((r for r, p in self.peers.items() if p["layout"] != mine), None)
        if other is not None:
            raise ConfigError(f"KV transfer group: rank {other}'s KV cache layout differs from this worker's "
                              f"(rank {rank}): {self.peers[other]['layout']} vs {mine}; every worker must serve the "
                              "same model with the same dtype, block size and KV cache type")
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            opts.is_high_priority_stream = True  # transfers go ahead of the engine's kernels (see transfer_thread)
            opts.global_ranks_in_group = list(range(world_size))
            opts.group_name = "nvllm_kv"
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self._store), rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self._store), rank, world_size, self.timeout)
        self._store_ref = store  # rank 0 serves the store: keep it alive with the group
        logger.info("joined the KV transfer group: rank %d of %d (%s), %s", rank, world_size, backend,
                    ", ".join(f"{r}={p['role']}" for r, p in sorted(self.peers.items())))

    def ranks(self, role: str) -> list[int]:
        return [r for r, p in self.peers.items() if p["role"] == role]

    def _header(self, tag: int, status: int, nbytes: int) -> torch.Tensor:
        return torch.tensor([tag, status, nbytes], dtype=torch.int64, device=self.device)

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            raise TransferError(f"{what} rank {peer} failed: {str(e).splitlines()[0][:200]}") from None

    def send(self, dst: int, tag: int, payload: torch.Tensor | None) -> None:
        """Send a header and (payload not None) the payload; None tells the receiver the transfer failed."""
        nbytes = 0 if payload is None else payload.numel()
        header = self._header(tag, STATUS_FAILED if payload is None else STATUS_OK, nbytes)
        self._wait(self.pg.send([header], dst, tag), "sending a header to", dst)
        if payload is not None:
            self._wait(self.pg.send([payload.to(self.device)], dst, tag), "sending KV to", dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def recv(self, src: int, tag: int, nbytes: int) -> torch.Tensor:
        """Receive one transfer of nbytes bytes; TransferError when it failed on the sender's side."""
        header = self._header(0, 0, 0)
        self._wait(self.pg.recv([header], src, tag), "receiving a header from", src)
        got_tag, status, size = header.tolist()
        if got_tag != tag:
            raise TransferError(f"rank {src} answered transfer {got_tag} where {tag} was expected (out of order)")
        if status != STATUS_OK:
            raise TransferError(f"rank {src} could not send the KV of transfer {tag}")
        if size != nbytes:
            raise TransferError(f"rank {src} sent {size} bytes where {nbytes} were expected")
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._wait(self.pg.recv([payload], src, tag), "receiving KV from", src)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return payload
