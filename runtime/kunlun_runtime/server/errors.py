"""HTTP errors of the server, all answered with OpenAI's error body.

Body: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status, as vLLM
answers. Invalid fields are 400 with the field in ``param`` (never 422), an unknown model 404, a
bad API key 401, a full queue 429 and a server that is loading or draining 503, both with
``Retry-After``. Anything unexpected is logged (without the request body) and answered 500; bad
input is expected to be caught before that.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kunlun_runtime.errors import EngineDeadError, InvalidRequestError, KunlunRuntimeError

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with its HTTP answer; raise it from a route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers


class QueueFullError(KunlunRuntimeError):
    """More requests would wait than ``--max-queue-len`` allows (429, retry later)."""


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def error_response(
    status_code: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status_code, "Error"),
            "param": param,
            "code": status_code,
        }
    }
    return JSONResponse(body, status_code=status_code, headers=headers)


def param_from_location(location: tuple | list) -> str | None:
    """``("body", "messages", 0, "content")`` → ``"messages.0.content"``; the bare body → None."""
    parts = [str(part) for part in location if part not in ("body", "query", "path")]
    return ".".join(parts) or None


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    param = param_from_location(first.get("loc", ()))
    message = str(first.get("msg", "invalid request"))
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status_code, error.message, error.param, error.headers)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(_: Request, error: InvalidRequestError) -> JSONResponse:
        return error_response(error.status_code, error.message, error.field)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(QueueFullError)
    async def on_queue_full(_: Request, error: QueueFullError) -> JSONResponse:
        return error_response(429, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(500, str(error))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.error(
            "unhandled %s on %s %s", type(error).__name__, request.method, request.url.path, exc_info=error
        )
        return error_response(500, "internal server error")
