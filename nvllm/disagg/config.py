"""Disaggregation settings of one `nvllm serve`: its role, its place in the KV transfer group, and — for
`--disaggregate xPyD` — the deployment to launch. Validated once; a mistake is one ConfigError line."""

from __future__ import annotations

import errno
import math
import re
import socket
from dataclasses import dataclass

from nvllm.config import ConfigError

ROLES = ("mixed", "prefill", "decode")
KV_BACKENDS = ("auto", "gloo", "nccl")


def parse_xpyd(text: str) -> tuple[int, int]:
    """'1P1D' → (1, 1), '2P3D' → (2, 3): prefill and decode worker counts."""
    m = re.fullmatch(r"\s*(\d+)\s*[Pp]\s*(\d+)\s*[Dd]\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError(f"--disaggregate takes xPyD with x, y >= 1 (e.g. 1P1D, 2P2D), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass
class DisaggConfig:
    role: str = "mixed"
    disaggregate: str | None = None  # "xPyD": launch x prefill and y decode workers and a router
    kv_rank: int | None = None  # this worker's rank in the KV transfer group
    kv_world_size: int | None = None  # every prefill and decode worker of the deployment
    kv_master: str | None = None  # HOST:PORT of the group's rendezvous store (rank 0 listens there)
    kv_store_external: bool = False  # another process serves the store at kv_master (--disaggregate's launcher)
    kv_backend: str = "auto"  # auto: NCCL between GPUs, gloo on CPU
    max_prefill_length: int | None = None  # prompts longer are refused (400) by a prefill worker
    prefill_max_num_seqs: int | None = None  # --disaggregate: the prefill workers' batch (default: max_num_seqs)
    kv_handle_timeout: float = 60.0  # seconds a prefilled sequence's blocks wait for its decode worker
    kv_transfer_timeout: float = 60.0  # seconds one transfer may take before it is given up

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}; choose mixed, prefill or decode")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(f"unknown KV backend {self.kv_backend!r}; choose auto, gloo or nccl")
        if self.max_prefill_length is not None and self.max_prefill_length < 1:
            raise ConfigError("--max-prefill-length must be at least 1")
        if self.prefill_max_num_seqs is not None and self.prefill_max_num_seqs < 1:
            raise ConfigError("--prefill-max-num-seqs must be at least 1")
        for flag, seconds in (("--kv-handle-timeout", self.kv_handle_timeout),
                              ("--kv-transfer-timeout", self.kv_transfer_timeout)):
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ConfigError(f"{flag} must be a positive number of seconds, got {seconds}")
        group = (self.kv_rank, self.kv_world_size, self.kv_master)
        if self.disaggregate is not None:
            parse_xpyd(self.disaggregate)
            if self.role != "mixed" or any(v is not None for v in group) or self.kv_store_external:
                raise ConfigError("--disaggregate launches the workers itself: it takes no --role, --kv-rank, "
                                  "--kv-world-size, --kv-master or --kv-store-external")
            return
        if self.prefill_max_num_seqs is not None:
            raise ConfigError("--prefill-max-num-seqs goes with --disaggregate (a prefill worker takes "
                              "--max-num-seqs)")
        if self.role == "mixed":
            if any(v is not None for v in group) or self.kv_store_external:
                raise ConfigError("--kv-rank, --kv-world-size, --kv-master and --kv-store-external need --role "
                                  "prefill or decode")
            if self.max_prefill_length is not None:
                raise ConfigError("--max-prefill-length needs --role prefill (or --disaggregate)")
            return
        if any(v is None for v in group):
            raise ConfigError(f"--role {self.role} needs --kv-rank, --kv-world-size and --kv-master (the KV "
                              "transfer group every prefill and decode worker joins)")
        if self.kv_world_size < 2 or not 0 <= self.kv_rank < self.kv_world_size:
            raise ConfigError(f"--kv-rank must be in [0, --kv-world-size) and the group needs at least a prefill "
                              f"and a decode worker; got rank {self.kv_rank} of {self.kv_world_size}")
        parse_host_port(self.kv_master, "--kv-master")
        if self.role == "decode" and self.max_prefill_length is not None:
            raise ConfigError("--max-prefill-length applies to prefill workers")

    @property
    def master(self) -> tuple[str, int]:
        return parse_host_port(self.kv_master, "--kv-master")

    def check_store_port(self) -> None:
        """Rank 0 serves the group's store on --kv-master's port (every interface): a port another process holds
        fails here, before the model loads, instead of minutes later at the rendezvous."""
        if self.role == "mixed" or self.kv_rank != 0 or self.kv_store_external:
            return
        host, port = self.master
        try:
            socket.create_server(("", port)).close()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--kv-master {host}:{port}: port {port} is taken, and rank 0 serves the KV "
                                  "transfer group's store there: pick a free port") from None
