"""Errors as OpenAI answers them: a status code and `{"error": {"message", "type", "param", "code"}}`.

Handlers registered here turn every failure into that shape — our own APIError, FastAPI's validation
errors (400, never 422), unknown routes — so no bad input ever reaches the client as a bare 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nvllm.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("nvllm")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "server_error"}
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                    "stop_token_ids", "logprobs", "prompt_logprobs", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "structured_outputs", "allowed_token_ids", "bad_words",
                    "truncate_prompt_tokens", "priority")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(e: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine is the caller's mistake: 400, naming the field."""
    message = str(e)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in _SAMPLING_FIELDS else None)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as one line and the field it names."""
    errors = e.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if loc[:1] == ["prompt"] and err.get("type") != "missing":  # a union: pydantic's first branch error misleads
        return "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", \
            "prompt"
    if loc[:1] == ["tool_choice"] and err.get("type") != "missing":  # a union too
        return "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": " \
            "{\"name\": ...}}", "tool_choice"
    field = ".".join(loc) or None
    return (f"{field}: {err.get('msg', 'invalid value')}" if field else err.get("msg", "invalid request")), \
        (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left while sending its body: nobody to answer, nothing wrong

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), None, None)

    app.add_middleware(UnexpectedErrors)


class UnexpectedErrors:
    """Any other exception before the response began: a 500 in the OpenAI shape on a connection that stays open.
    (A handler for ``Exception`` runs in Starlette's outermost middleware, which re-raises after answering, and
    the server then drops the connection under a client that already sent its next request on it.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:  # a stream that failed mid-way: nothing more can be said on it
                raise
            logger.exception("unexpected error serving %s", scope.get("path"))
            await error_response(500, f"internal error: {type(e).__name__}: {e}")(scope, receive, send)
