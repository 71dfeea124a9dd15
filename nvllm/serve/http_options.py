"""How a client-facing endpoint (`nvllm serve`, `nvllm router`) meets browsers and TLS, with vLLM's flags and
defaults: CORS headers (Starlette's CORSMiddleware; every origin allowed unless narrowed, as in vLLM) and HTTPS
from a certificate and key (uvicorn's TLS; the files are checked before the model loads)."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nvllm.cli_options import option_group
from nvllm.config import ConfigError

_PANEL = "HTTP (CORS, TLS)"


def _opt(default: Any, annotation: Any, help: str) -> tuple[Any, Any]:
    return default, Annotated[annotation, typer.Option(help=help, rich_help_panel=_PANEL)]


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
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not a JSON list ({e.msg})") from None
        if not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{flag}: the list must hold non-empty strings, got {text}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


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
        """The server's TLS context, as uvicorn builds it; ConfigError for a missing or unreadable file."""
        for flag, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path and not Path(path).expanduser().is_file():
                raise ConfigError(f"{flag} {path} does not exist")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(str(Path(self.ssl_certfile).expanduser()),
                                str(Path(self.ssl_keyfile).expanduser()) if self.ssl_keyfile else None)
            if self.ssl_ca_certs:
                ctx.load_verify_locations(str(Path(self.ssl_ca_certs).expanduser()))
        except ssl.SSLError as e:
            raise ConfigError(f"cannot use the TLS files ({e.reason or e}): --ssl-certfile must hold the "
                              "certificate chain and, without --ssl-keyfile, its key, in PEM") from None
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



# Decorator: HTTP_OPTIONS among a command's flags; the command receives ``http_options: HTTPOptions``.
http_options = option_group(HTTP_OPTIONS, HTTPOptions, "http_options")
