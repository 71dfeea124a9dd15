"""`nvllm router`'s HTTP face: the FastAPI app over a ``Router`` (nvllm.disagg.router) and the process that serves
it until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nvllm.disagg.router import Router
from nvllm.disagg.router_config import RouterConfig
from nvllm.serve.errors import APIError, install_error_handlers
from nvllm.serve.http import check_api_key, probe_routes

logger = logging.getLogger("nvllm")


def build_router_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(router.background())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await router.client.aclose()

    app = FastAPI(title="nvllm router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    install_error_handlers(app)
    cfg.http.install(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route("chat", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await router.respond(request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await router.stored_response(request, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.any_worker(request, "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.any_worker(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.any_worker(request, "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        if router.healthy():
            return Response(status_code=200)
        return JSONResponse({"status": "waiting for workers",
                             "workers": [w.public() for w in router.pool.workers]}, status_code=503)

    probe_routes(app, health)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        await router.pool.poll_all()  # the workers' counters as of now, not of the last poll
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kernel_report")
    async def kernel_report(request: Request) -> dict:
        check_api_key(request, cfg.api_key)
        report = await router.pool.kernel_report()
        if report is None:
            raise APIError(503, "no worker answered its kernel report", code="no_worker_available")
        return report

    @app.get("/router/workers")
    async def workers(request: Request) -> dict:
        check_api_key(request, cfg.api_key)
        return {"workers": [w.public() for w in router.pool.workers]}

    return app


class _RouterServer(uvicorn.Server):
    """uvicorn's graceful shutdown, and ``on_grace`` called once ``grace`` seconds of it have passed: the
    --disaggregate launcher then has its workers abort what still runs, so every stream still ends properly (its
    last chunk, then [DONE]) before uvicorn gives up on it."""

    def __init__(self, config: uvicorn.Config, grace: float, on_grace: Callable[[], None] | None,
                 on_shutdown: Callable[[], None] | None):
        super().__init__(config)
        self.grace, self.on_grace, self.on_shutdown = grace, on_grace, on_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        timer = asyncio.get_running_loop().call_later(self.grace, self.on_grace) if self.on_grace else None
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def run_router(cfg: RouterConfig, sock=None, on_grace: Callable[[], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; sock: the listening socket when the caller bound it already; on_shutdown: called
    as a shutdown begins; on_grace: called --shutdown-timeout seconds into it (the router then waits a few seconds
    more for the last chunks)."""
    from nvllm.logger import setup_logging
    from nvllm.serve.graceful import FLUSH_S, KEEP_ALIVE_S, exit_quietly_after_signals
    from nvllm.serve.sockets import listen_socket

    setup_logging()
    sock = sock or listen_socket(cfg.host, cfg.port, cfg.fd)
    try:
        app = build_router_app(cfg)
        host, port = sock.getsockname()[:2]
        logger.info("router at %s://%s:%d/v1: %s", cfg.http.scheme, host, port,
                    f"mixed {', '.join(cfg.mixed)}" if cfg.mixed else
                    f"prefill {', '.join(cfg.prefill)}; decode {', '.join(cfg.decode)}")
        flush = 2 * FLUSH_S if on_grace is not None else 0  # the workers' abort and their last chunks, relayed
        server = _RouterServer(uvicorn.Config(app, log_level=cfg.log_level, timeout_keep_alive=KEEP_ALIVE_S,
                                              timeout_graceful_shutdown=cfg.shutdown_timeout + flush,
                                              **cfg.http.uvicorn_kwargs()), cfg.shutdown_timeout, on_grace,
                              on_shutdown)
        with exit_quietly_after_signals():
            server.run(sockets=[sock])
    finally:
        sock.close()
    logger.info("router stopped")
