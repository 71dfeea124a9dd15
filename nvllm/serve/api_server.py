"""The OpenAI-compatible HTTP server: a FastAPI app on the AsyncLLMEngine, run by uvicorn.

`build_app` wires the routes; `run_server` builds the engine (so a bad model fails before anything
listens), binds the socket (so a taken port is one clear error), and serves until SIGINT/SIGTERM, when
in-flight requests get `shutdown_timeout` seconds to finish before they are aborted."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nvllm.chat_template import CONTENT_FORMATS, check_chat_template, read_chat_template
from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.async_engine import AsyncLLMEngine
from nvllm.engine.output_stream import EngineDeadError
from nvllm.engine.generation_defaults import announce
from nvllm.lora.request import LoRARequest
from nvllm.serve.chat import ChatHandler
from nvllm.serve.models import ServedModels, lora_routes
from nvllm.serve.response_events import response_events
from nvllm.serve.responses import ResponsesHandler, ResponsesRequest
from nvllm.reasoning_parsers import get_reasoning_parser
from nvllm.serve.tool_parsers import TOOL_PARSERS, get_tool_parser
from nvllm.serve.completions import CompletionHandler
from nvllm.serve.errors import APIError, from_value_error, install_error_handlers
from nvllm.serve.http import (ClientGone, EventStreamResponse, check_api_key, on_response_thread, parse_body,
                              probe_routes, until_disconnect)
from nvllm.serve.http_options import HTTPOptions, check_listener
from nvllm.serve.metrics import ServerMetrics
from nvllm.serve.params import logprobs_limit
from nvllm.serve.prompts import PromptProcessor
from nvllm.serve.graceful import (FLUSH_S, KEEP_ALIVE_S, GracefulServer, abort_on_sigusr1,
                                  exit_quietly_after_signals)
from nvllm.serve.sockets import listen_socket, url_host
from nvllm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                  ModelList, TokenizeRequest, TokenizeResponse)

if TYPE_CHECKING:
    from nvllm.disagg.config import DisaggConfig
    from nvllm.disagg.worker import DisaggWorker

logger = logging.getLogger("nvllm")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # the names clients send (the first is the one responses carry); default: the --model argument (the demo
    # model: "stories260K")
    served_model_name: str | list[str] | None = None
    chat_template: str | None = None  # a Jinja file or template text; default: the tokenizer's, else a fallback
    max_request_bytes: int = 16 * 1024 * 1024
    shutdown_timeout: int = 30
    log_level: str = "info"
    fd: int | None = None  # an inherited, bound socket to serve on instead of host:port (uvicorn's --fd)
    # tool_choice "auto": the model's calls taken out of its text by this parser (nvllm.serve.tool_parsers)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    lora_modules: list[LoRARequest] = field(default_factory=list)  # adapters clients pick by name (--enable-lora)
    http: HTTPOptions = field(default_factory=HTTPOptions)  # CORS and TLS
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" unless a request says otherwise
    chat_template_content_format: str = "auto"  # auto | string | openai (nvllm.chat_template.render_chat)

    def __post_init__(self) -> None:
        self.log_level = check_listener(self.port, self.log_level, self.api_key, self.max_request_bytes,
                                        self.shutdown_timeout)
        names = self.served_model_name
        names = [names] if isinstance(names, str) else list(names or [])
        if not all(isinstance(n, str) and n for n in names):
            raise ConfigError("--served-model-name must not be empty")
        self.served_model_name = names or None
        if self.chat_template is not None:
            try:
                check_chat_template(read_chat_template(self.chat_template))
            except (OSError, UnicodeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"unknown --chat-template-content-format {self.chat_template_content_format!r}; "
                              f"choose {', '.join(CONTENT_FORMATS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"unknown tool call parser {self.tool_call_parser!r}; choose "
                              f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes for Qwen2.5/Qwen3, "
                              "llama3_json for Llama 3.x, mistral for Mistral)")


@dataclass
class ServingContext:
    """What the OpenAI routes share, for the routes a disaggregation role adds beside them."""

    engine: AsyncLLMEngine
    config: ServerConfig
    model_name: str
    prompts: PromptProcessor
    metrics: ServerMetrics
    handlers: dict[str, CompletionHandler | ChatHandler]  # "completions", "chat"
    check_model: Callable[[str | None], None]
    # answer(handler, req, request, start=None): the OpenAI response; start replaces handler.start
    answer: Callable[..., Awaitable[Response]]


def _json_response(body) -> JSONResponse:
    """A whole response encoded (run off the event loop: a large one takes seconds)."""
    return JSONResponse(body.model_dump())


def default_model_name(engine_config: EngineConfig) -> str:
    from nvllm.assets import demo_model_path

    if Path(engine_config.model).resolve() == Path(demo_model_path()).resolve():
        return "stories260K"
    return engine_config.model


def build_app(engine: AsyncLLMEngine, config: ServerConfig, model_name: str,
              worker: "DisaggWorker | None" = None) -> FastAPI:
    """The app; a prefill or decode worker (disaggregation) adds its internal routes."""
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.kernels import report

    core = engine.engine
    prompts = PromptProcessor(load_tokenizer(core.config.tokenizer), core.vocab_size, core.max_model_len,
                              config.chat_template, config.return_tokens_as_token_ids,
                              config.chat_template_content_format)
    metrics = ServerMetrics(core, model_name)
    engine.output_hooks.append(metrics.observe)
    defaults = core.generation_defaults  # the model's sampling defaults, for request fields left unset
    announce(defaults)
    models = ServedModels(model_name, core.config.model, core.max_model_len, config.lora_modules,
                          (config.served_model_name or [])[1:])
    if config.lora_modules and not core.config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    for adapter in config.lora_modules:  # a bad adapter stops the start, as vLLM checks them
        core.load_lora(adapter)
    completions = CompletionHandler(engine, prompts, models, defaults, logprobs_limit(core))
    auto_tools = get_tool_parser(config.tool_call_parser) if config.enable_auto_tool_choice else None
    reasoning = get_reasoning_parser(core.config.reasoning_parser) if core.config.reasoning_parser else None
    chat = ChatHandler(engine, prompts, models, defaults, auto_tools, reasoning, logprobs_limit(core))
    responses = ResponsesHandler(chat)
    limit = config.max_request_bytes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        logger.info("shutting down: aborting what is still in flight")
        if worker is not None:
            worker.stop()
        await engine.shutdown()

    app = FastAPI(title="nvllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    config.http.install(app)

    def authorized(request: Request) -> None:
        check_api_key(request, config.api_key)

    check_model = models.check

    async def answer(handler, req, request: Request, start=None) -> Response:
        check_model(req.model)
        if request.headers.get("x-request-id"):  # names the response, before the body's request_id (as vLLM)
            req.request_id = request.headers["x-request-id"][:256]
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if req.use_beam_search and start is None:
            try:
                body = await until_disconnect(request, handler.beam(req))
            except ClientGone:
                return Response(status_code=499)
            except EngineDeadError as e:
                raise APIError(503, str(e), code="engine_unavailable") from None
            except ValueError as e:  # the search's own checks (a prompt that leaves no room)
                raise from_value_error(e) from None
            return await on_response_thread(_json_response, body)
        try:  # a client gone while the prompts are tokenized and queued: nothing stays queued
            request_id, stream, prompt_ids = await until_disconnect(request, (start or handler.start)(req))
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        if req.stream:
            return EventStreamResponse(handler.chunks(req, request_id, stream, prompt_ids), on_close=stream.close)
        try:
            body = await until_disconnect(request, handler.full(req, request_id, stream, prompt_ids))
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; the requests are aborted below
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            stream.close()  # a no-op when they finished; aborts them when anything cut the wait short
        return await on_response_thread(_json_response, body)

    api = APIRouter(dependencies=[Depends(authorized)])

    @api.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await answer(completions, await parse_body(request, CompletionRequest, limit), request)

    @api.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await answer(chat, await parse_body(request, ChatCompletionRequest, limit), request)

    @api.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest, limit)
        check_model(req.model)
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        try:
            ids, stream, prompt_ids = await until_disconnect(request, responses.start(req))
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        if req.stream:
            return EventStreamResponse(responses.events(req, ids, stream, prompt_ids), on_close=stream.close,
                                       framing=response_events)
        try:
            body = await until_disconnect(request, responses.full(req, ids, stream, prompt_ids))
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            stream.close()
        return JSONResponse(body)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse(responses.store.get(response_id, "response_id")[1])

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return models.cards()

    @api.get("/v1/kernel_report")
    async def kernel_report() -> dict:
        return report.snapshot()

    @api.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        req = await parse_body(request, TokenizeRequest, limit)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", "prompt")

        def encode(req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
            if req.messages is not None:
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                text = prompts.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                           req.chat_template_kwargs, tools)
                special = prompts.fallback_template if req.add_special_tokens is None else req.add_special_tokens
            else:
                text, special = req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
            ids = prompts.tokenizer.encode(text, add_special_tokens=special)
            return ids, prompts.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

        ids, strs = await prompts.off_loop(encode, req)
        return TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=ids, token_strs=strs)

    @api.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        req = await parse_body(request, DetokenizeRequest, limit)
        check_model(req.model)

        def decode(tokens: list[int]) -> str:  # on a tokenizer thread, as /tokenize: millions of ids take seconds
            prompts.check_ids(tokens, "tokens")
            return prompts.decode(tokens)

        return DetokenizeResponse(prompt=await prompts.off_loop(decode, req.tokens))

    if os.environ.get("NVLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):
        api.include_router(lora_routes(models, engine, limit))

    if worker is not None:
        api.include_router(worker.routes(ServingContext(engine, config, model_name, prompts, metrics,
                                                        {"completions": completions, "chat": chat}, check_model,
                                                        answer)))
    app.include_router(api)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return Response(status_code=200)

    probe_routes(app, health)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(engine_config: EngineConfig, config: ServerConfig, disagg: "DisaggConfig | None" = None) -> int:
    """Build the engine (and, for a prefill or decode worker, join the KV transfer group), then serve until
    SIGINT/SIGTERM (uvicorn handles both), or until the engine's loop dies. Returns the exit status: 0, or 1 when
    the server stopped because the engine died."""
    from nvllm.engine.llm_engine import LLMEngine
    from nvllm.logger import setup_logging

    setup_logging()
    sock = listen_socket(config.host, config.port, config.fd)  # before the slow part, so a taken port fails at once
    engine = None
    try:
        if disagg is not None:
            disagg.check_store_port()
        model_name = config.served_model_name[0] if config.served_model_name else default_model_name(engine_config)
        if disagg is not None and disagg.role == "prefill" and engine_config.async_scheduling:
            # its steps end every sequence after one token, which the handoff needs at once: nothing to overlap.
            # (A decode worker keeps it: its KV receiver orders each write into the pool after the engine's queued
            # steps, which may still touch a block freed under them; see KVReceiver.)
            logger.info("asynchronous scheduling off on a prefill worker")
            engine_config.async_scheduling = False
        engine = AsyncLLMEngine(LLMEngine(engine_config))
        worker = None
        if disagg is not None and disagg.role != "mixed":
            from nvllm.disagg.worker import DisaggWorker

            host, port = sock.getsockname()[:2]
            reach = url_host(config.host if config.fd is None else host, host)
            worker = DisaggWorker(engine, disagg, config, f"http://{reach}:{port}")
        app = build_app(engine, config, model_name, worker)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s at %s://%s:%d/v1 (API key %s)", model_name, config.http.scheme, host, port,
                    "required" if config.api_key else "not required")
        server = GracefulServer(uvicorn.Config(app, log_level=config.log_level, timeout_keep_alive=KEEP_ALIVE_S,
                                               timeout_graceful_shutdown=config.shutdown_timeout + FLUSH_S,
                                               **config.http.uvicorn_kwargs()),
                                engine, config.shutdown_timeout)
        with exit_quietly_after_signals(), abort_on_sigusr1(server):
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C while the model loads: nothing is serving yet
        logger.info("interrupted before serving")
        return 0
    finally:
        sock.close()
        if engine is not None:  # a second Ctrl-C cuts uvicorn's shutdown short: the loop still ends before teardown
            engine.stop(timeout=10)
    logger.info("server stopped")
    return 1 if server.engine_died else 0
