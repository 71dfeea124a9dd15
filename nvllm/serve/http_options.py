"""How a client-facing endpoint (`nvllm serve`, `nvllm router`) meets browsers and TLS, with vLLM's flags and
defaults: CORS headers (Starlette's CORSMiddleware; every origin allowed unless narrowed, as in vLLM) and HTTPS
from a certificate and key (uvicorn's TLS; the files are checked before the model loads)."""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any, Optional

from nvllm.cli_options import option_group, panel_option
from nvllm.config import ConfigError

logger = logging.getLogger("nvllm")

_opt = panel_option("HTTP (CORS, TLS)")


HTTP_OPTIONS: dict[str, tuple[Any, Any]] = {
    "allowed_origins": _opt('["*"]', str, "origins browsers may call from: a JSON list (as vLLM's) or "
                            "comma-separated; '[]' sends no CORS headers"),
    "allowed_methods": _opt('["*"]', str, "CORS: the methods allowed (JSON list or comma-separated)"),
    "allowed_headers": _opt('["*"]', str, "CORS: the request headers allowed (JSON list or comma-separated)"),
    "allow_credentials": _opt(False, bool, "CORS: let browsers send credentials (cookies, HTTP authentication)"),
    "ssl_keyfile": _opt(None, Optional[str], "serve HTTPS: the private key (PEM; may be inside --ssl-certfile)"),
    "ssl_certfile": _opt(None, Optional[str], "serve HTTPS: the certificate chain (PEM)"),
    "ssl_ca_certs": _opt(None, Optional[str], "CA certificates (PEM) that client certificates are checked "
                         "against"),
    "ssl_cert_reqs": _opt(0, int, "client certificates: 0 not asked, 1 checked if sent, 2 required (Python's "
                          "ssl.CERT_*)"),
}


def _names(text: str, flag: str) -> list[str]:
    """A JSON list of strings, or comma-separated names."""
    text = text.strip()
    if text[:1] in '["{':
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not a JSON list ({e.msg})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{flag}: give a JSON list of non-empty strings (or comma-separated names), got "
                              f"{text}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


# what a browser sends as Origin: "null", or scheme://host[:port] with no path
_ORIGIN = re.compile(r"^(null|[a-z][a-z0-9+.-]*://[^/?#\s]+)$", re.IGNORECASE)


@dataclass
class HTTPOptions:
    allowed_origins: list[str] | str = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] | str = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] | str = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, _names(value, "--" + name.replace("_", "-")))
        bad = next((o for o in self.allowed_origins if o != "*" and not _ORIGIN.match(o)), None)
        if bad is not None:
            raise ConfigError(f"--allowed-origins: {bad!r} is not an origin as browsers send it (scheme://host[:port], "
                              "no path or trailing slash), nor '*'")
        if self.allow_credentials and "*" in self.allowed_origins:
            logger.warning("--allow-credentials with every origin allowed: any web page may send credentialed "
                           "requests; narrow --allowed-origins")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):  # as uvicorn will open them, ~ expanded
            if getattr(self, name):
                setattr(self, name, os.path.expanduser(getattr(self, name)))
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ConfigError("--ssl-keyfile needs --ssl-certfile (the certificate the key belongs to)")
        if not self.tls and (self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (client certificates are "
                              "asked for over HTTPS only)")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ConfigError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check client certificates against")
        if self.tls:
            self.ssl_context()  # a missing file or a key that does not fit: said now, not after the model loads

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def ssl_context(self) -> ssl.SSLContext:
        """The server's TLS context, as uvicorn builds it; ConfigError for a missing or unusable file."""
        for flag, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path} " + ("is not a file" if os.path.exists(path) else "does not exist"))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # an encrypted key is refused at once: the server must start without anyone typing a pass phrase
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=_no_pass_phrase)
        except _Encrypted:
            raise ConfigError("the TLS private key is encrypted; give an unencrypted key (e.g. `openssl pkey -in "
                              "KEY -out PLAIN`) with file permissions that protect it") from None
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ConfigError(f"cannot use --ssl-certfile/--ssl-keyfile ({getattr(e, 'reason', None) or e}): the "
                              "certificate chain and its key (in the certfile unless --ssl-keyfile), in PEM") from None
        if self.ssl_ca_certs:
            try:
                ctx.load_verify_locations(self.ssl_ca_certs)
            except (ssl.SSLError, OSError, ValueError) as e:
                raise ConfigError(f"cannot use --ssl-ca-certs {self.ssl_ca_certs} ({getattr(e, 'reason', None) or e})"
                                  ": it must hold CA certificates in PEM") from None
        return ctx

    def install(self, app) -> None:
        """CORS headers on every route (none when no origin is allowed)."""
        if not self.allowed_origins:
            return
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                           allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        if not self.tls:
            return {}
        return dict(ssl_certfile=self.ssl_certfile, ssl_keyfile=self.ssl_keyfile, ssl_ca_certs=self.ssl_ca_certs,
                    ssl_cert_reqs=self.ssl_cert_reqs)


class _Encrypted(Exception):
    pass


def _no_pass_phrase() -> bytes:
    raise _Encrypted


# Decorator: HTTP_OPTIONS among a command's flags; the command receives ``http_options: HTTPOptions``.
http_options = option_group(HTTP_OPTIONS, HTTPOptions, "http_options")


def checked_log_level(value: str) -> str:
    """--uvicorn-log-level, checked before the model loads (uvicorn raised a KeyError once the server started)."""
    from uvicorn.config import LOG_LEVELS

    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise ConfigError(f"--uvicorn-log-level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def check_listener(port: int, log_level: str, api_key: str | None, max_request_bytes: int,
                   shutdown_timeout: int) -> str:
    """The settings `nvllm serve` and `nvllm router` share, checked alike before either starts (an empty key or a
    zero body limit would refuse every request); returns the log level, lowercased."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"port must be in [0, 65535], got {port}")
    if api_key is not None and not api_key:
        raise ConfigError("api_key must not be empty")
    if max_request_bytes < 1:
        raise ConfigError("max_request_bytes must be at least 1")
    if shutdown_timeout < 0:
        raise ConfigError("--shutdown-timeout must be non-negative")
    return checked_log_level(log_level)
