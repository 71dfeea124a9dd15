"""The listening socket of a server (`nvllm serve`, `nvllm router`, the disaggregated launcher's workers): bound
here to --host/--port, or inherited already bound (--fd), and the address other workers reach it at."""

from __future__ import annotations

import socket

from nvllm.config import ConfigError


def url_host(configured: str, bound: str) -> str:
    """The address other workers reach this one at: the bound one, loopback for a wildcard bind."""
    host = configured if configured not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"[{host}]" if ":" in host else host or bound


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def adopt_socket(fd: int) -> socket.socket:
    """The bound TCP socket behind an inherited file descriptor (``--fd``: bound by whoever started this process,
    so no other process can take its port in between)."""
    if fd < 0:   # (socket.socket(fileno=-1) would open a new socket)
        raise ConfigError(f"--fd must be a file descriptor (>= 0), got {fd}")
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ConfigError(f"--fd {fd} is not an open socket: {e.strerror or e}") from None
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ConfigError(f"--fd {fd} is not a TCP socket")
    if sock.getsockname()[1] == 0:
        sock.detach()
        raise ConfigError(f"--fd {fd}: the socket is not bound to a port")
    return sock


def listen_socket(host: str, port: int, fd: int | None) -> socket.socket:
    """The socket to serve on: the inherited one (``--fd``), else ``--host``:``--port`` bound here."""
    return adopt_socket(fd) if fd is not None else bind_socket(host, port)
