"""`nvllm router`'s settings: the worker URLs it fronts, where it listens, and its limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx

from nvllm.config import ConfigError
from nvllm.serve.http_options import HTTPOptions, check_listener


def parse_urls(text: str | None, flag: str) -> list[str]:
    """Comma-separated worker URLs, each checked (``check_url``)."""
    urls = [u.strip().rstrip("/") for u in (text or "").split(",") if u.strip()]
    for u in urls:
        check_url(u, flag)
    return urls


def check_url(u: str, flag: str) -> None:
    """An http(s) URL with a host and a valid port (httpx parses it as the client will), or a ConfigError naming
    ``flag``: the router's worker URLs, a benchmark's --base-url."""
    if not u.startswith(("http://", "https://")):
        raise ConfigError(f"{flag}: {u!r} is not an http(s):// URL")
    try:
        url = httpx.URL(u)
        port = url.port
    except (httpx.InvalidURL, ValueError) as e:
        raise ConfigError(f"{flag}: {u!r} is not a valid URL ({e})") from None
    if not url.host:
        raise ConfigError(f"{flag}: {u!r} names no host")
    if port is not None and not 0 < port <= 65535:
        raise ConfigError(f"{flag}: {u!r} has port {port}; ports are 1-65535")


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    mixed: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    poll_interval: float = 1.0
    log_interval: float = 10.0
    log_level: str = "info"
    fd: int | None = None  # an inherited, bound socket to serve on instead of host:port (as `nvllm serve --fd`)
    shutdown_timeout: int = 30  # seconds in-flight requests get on SIGINT/SIGTERM (as `nvllm serve`'s)
    http: HTTPOptions = field(default_factory=HTTPOptions)  # CORS and TLS (as `nvllm serve`'s)

    def __post_init__(self) -> None:
        if self.mixed and (self.prefill or self.decode):
            raise ConfigError("give either --mixed replicas or --prefill and --decode workers, not both")
        if not self.mixed and not (self.prefill and self.decode):
            raise ConfigError("the router needs --prefill and --decode worker URLs (or --mixed replica URLs)")
        if len(set(self.prefill + self.decode + self.mixed)) != len(self.prefill + self.decode + self.mixed):
            raise ConfigError("a worker URL is listed twice")
        self.log_level = check_listener(self.port, self.log_level, self.api_key, self.max_request_bytes,
                                        self.shutdown_timeout)
        if not (self.poll_interval > 0 and math.isfinite(self.poll_interval)):
            raise ConfigError(f"--poll-interval must be a positive number of seconds, got {self.poll_interval}")
        if not (self.log_interval >= 0 and math.isfinite(self.log_interval)):
            raise ConfigError(f"--log-interval must be a non-negative number of seconds (0: off), got "
                              f"{self.log_interval}")

