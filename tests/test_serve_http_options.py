"""CORS and HTTPS on `nvllm serve` and `nvllm router` (vLLM's flags): the options' checks,
the official openai client over HTTPS against the real server, browsers' preflights answered by Starlette's
CORSMiddleware."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from nvllm.config import ConfigError
from nvllm.serve.http_options import HTTPOptions
from tests.server_utils import spawn, start_server, stop_server

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA, a certificate for 127.0.0.1 signed by it (chain and key in one PEM, and apart) and a client
    certificate."""
    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("client@example")
    files = {"ca": root / "ca.pem", "both": root / "server.pem", "cert": root / "cert.pem", "key": root / "key.pem",
             "client": root / "client.pem"}
    ca.cert_pem.write_to_path(files["ca"])
    server.private_key_and_cert_chain_pem.write_to_path(files["both"])
    server.private_key_pem.write_to_path(files["key"])
    for blob in server.cert_chain_pems:
        blob.write_to_path(files["cert"], append=True)
    client.private_key_and_cert_chain_pem.write_to_path(files["client"])
    return {k: str(v) for k, v in files.items()}


def _trust(tls_files) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=tls_files["ca"])


def test_lists_as_json_or_comma_separated():
    h = HTTPOptions(allowed_origins='["https://a.example", "http://b.example:3000"]', allowed_methods="GET, POST",
                    allowed_headers="[]")
    assert h.allowed_origins == ["https://a.example", "http://b.example:3000"]
    assert h.allowed_methods == ["GET", "POST"] and h.allowed_headers == []
    assert HTTPOptions().allowed_origins == ["*"] and HTTPOptions().scheme == "http"
    assert HTTPOptions().uvicorn_kwargs() == {}


def test_home_in_tls_paths_is_expanded_for_uvicorn_too(tls_files, monkeypatch):
    import pathlib

    monkeypatch.setenv("HOME", str(pathlib.Path(tls_files["both"]).parent))
    h = HTTPOptions(ssl_certfile="~/server.pem")
    assert h.uvicorn_kwargs()["ssl_certfile"] == tls_files["both"]


def test_tls_files_are_checked_up_front(tls_files, tmp_path):
    assert HTTPOptions(ssl_certfile=tls_files["both"]).scheme == "https"
    assert HTTPOptions(ssl_certfile=tls_files["cert"], ssl_keyfile=tls_files["key"],
                       ssl_ca_certs=tls_files["ca"], ssl_cert_reqs=2).uvicorn_kwargs()["ssl_cert_reqs"] == 2
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(open(tls_files["key"], "rb").read(), password=None)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    cases = [
        (dict(ssl_keyfile=tls_files["key"]), "--ssl-keyfile needs --ssl-certfile"),
        (dict(ssl_certfile=str(tmp_path / "missing.pem")), "--ssl-certfile .*missing.pem does not exist"),
        (dict(ssl_certfile=tls_files["cert"]), "cannot use --ssl-certfile/--ssl-keyfile"),  # the key is in neither file
        (dict(ssl_certfile=str(bad)), "cannot use --ssl-certfile/--ssl-keyfile"),
        (dict(ssl_certfile=tls_files["both"], ssl_cert_reqs=2), "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs"),
        (dict(ssl_certfile=tls_files["both"], ssl_cert_reqs=3), "--ssl-cert-reqs must be 0, 1 or 2"),
        (dict(ssl_ca_certs=tls_files["ca"]), "need --ssl-certfile"),
        (dict(allowed_origins='["https://a", 1]'), "--allowed-origins: give a JSON list of non-empty strings"),
        (dict(allowed_origins='"https://a"'), "--allowed-origins: give a JSON list"),
        (dict(allowed_origins='["a"'), "--allowed-origins: not a JSON list"),
        (dict(allowed_origins="https://a.example/"), "'https://a.example/' is not an origin as browsers send it"),
        (dict(allowed_origins="a.example"), "'a.example' is not an origin"),
        (dict(ssl_certfile=str(tmp_path)), f"--ssl-certfile {tmp_path} is not a file"),
        (dict(ssl_certfile=tls_files["both"], ssl_ca_certs=str(bad)), "cannot use --ssl-ca-certs"),
        (dict(ssl_certfile=tls_files["cert"], ssl_keyfile=str(encrypted)), "the TLS private key is encrypted"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            HTTPOptions(**kwargs)


def _nvllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvllm.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_cli_mistakes_are_one_line_before_the_model_loads(tls_files, tmp_path):
    r = _nvllm("serve", "--ssl-certfile", str(tmp_path / "nope.pem"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("nope.pem does not exist")
    assert "Traceback" not in r.stderr
    r = _nvllm("serve", "--role", "prefill", "--kv-rank", "0", "--kv-world-size", "2", "--kv-master",
               "127.0.0.1:1", "--ssl-certfile", tls_files["both"])
    assert r.returncode == 2 and "serve HTTPS from `nvllm router`" in r.stderr
    r = _nvllm("router", "--mixed", "http://127.0.0.1:1", "--allowed-origins", "[1]")
    assert r.returncode == 2 and "--allowed-origins: give a JSON list of non-empty strings" in r.stderr


@pytest.fixture(scope="module")
def https_server(tls_files, tmp_path_factory):
    log = tmp_path_factory.mktemp("https") / "server.log"
    proc, base = start_server(["--ssl-certfile", tls_files["cert"], "--ssl-keyfile", tls_files["key"],
                               "--allowed-origins", '["https://app.example"]', "--api-key", "k", "--max-num-seqs", "4",
                               "--log-stats-interval", "0"], log, verify=_trust(tls_files))
    yield base, log
    stop_server(proc)


def test_openai_client_over_https(https_server, tls_files):
    base, log = https_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="k",
                           http_client=httpx.Client(verify=_trust(tls_files)))
    out = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
        httpx.get(base.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust the certificate
        httpx.get(f"{base}/health", timeout=5)
    assert f"at {base}/v1" in log.read_text()


def test_cors_preflight_and_reply(https_server, tls_files):
    base, _ = https_server
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://app.example", **ask},
                       verify=_trust(tls_files))
    assert ok.status_code == 200  # no API key on a preflight: browsers send none
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://evil.example", **ask},
                          verify=_trust(tls_files))
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    reply = httpx.post(f"{base}/v1/completions", verify=_trust(tls_files),
                       headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
                       json={"model": "stories260K", "prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"


def test_router_allows_every_origin_by_default_and_none_when_told():
    from starlette.testclient import TestClient

    from nvllm.disagg.router_app import build_router_app
    from nvllm.disagg.router_config import RouterConfig

    ask = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    open_app = build_router_app(RouterConfig(mixed=["http://127.0.0.1:9"]))
    r = TestClient(open_app).options("/v1/chat/completions", headers=ask)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    closed = build_router_app(RouterConfig(mixed=["http://127.0.0.1:9"], http=HTTPOptions(allowed_origins="[]")))
    r = TestClient(closed).options("/v1/chat/completions", headers=ask)
    assert "access-control-allow-origin" not in r.headers


def test_router_over_https_asking_client_certificates(tls_files, tmp_path):
    """`--ssl-cert-reqs 2`: a client without a certificate from --ssl-ca-certs is turned away in the handshake;
    one with it reaches the router (503 here: its one replica is not up)."""
    proc, base = spawn("router", ["--mixed", "http://127.0.0.1:9", "--ssl-certfile", tls_files["both"],
                                  "--ssl-ca-certs", tls_files["ca"], "--ssl-cert-reqs", "2"], tmp_path / "router.log")
    base = base.replace("http://", "https://")
    try:
        with_cert = _trust(tls_files)
        with_cert.load_cert_chain(tls_files["client"])
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{base}/health", verify=with_cert, timeout=2)
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.25)
        assert r.status_code == 503
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", verify=_trust(tls_files), timeout=5)
        assert f"router at {base}/v1" in (tmp_path / "router.log").read_text()
    finally:
        stop_server(proc)


def test_router_before_https_replicas_says_why_and_trusts_ssl_cert_file(https_server, tls_files, tmp_path,
                                                                         monkeypatch):
    """A replica whose certificate the router cannot verify is down with the reason; SSL_CERT_FILE (httpx's) names
    a private CA."""
    base, _ = https_server
    for trust in (None, tls_files["ca"]):
        if trust:
            monkeypatch.setenv("SSL_CERT_FILE", trust)
        proc, router = spawn("router", ["--mixed", base, "--api-key", "k", "--poll-interval", "0.2"],
                             tmp_path / f"router-{bool(trust)}.log")
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    workers = httpx.get(f"{router}/router/workers", headers={"Authorization": "Bearer k"},
                                        timeout=2).json()["workers"]
                    if workers[0]["up"] == bool(trust) and (trust or workers[0]["problem"]):
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, workers
                time.sleep(0.2)
            if not trust:
                assert "CERTIFICATE_VERIFY_FAILED" in workers[0]["problem"]
        finally:
            stop_server(proc)
