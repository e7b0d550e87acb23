"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}``, and the
mapping of every failure (bad request, worker error, Redis down, a pydantic validation error)
onto them."""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import INVALID_REQUEST, TOO_LONG
from common.protocol import REQUEST_KEYWORDS
from producer.types import GenerationError

log = logging.getLogger("tokenq.gateway")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def generation_error(e: GenerationError) -> APIError:
    if e.code in (INVALID_REQUEST, TOO_LONG):
        return APIError(400, e.message, "invalid_request_error", None, e.code)
    if e.code in ("timeout", "wait_timeout"):
        return APIError(504, e.message, "timeout_error", None, "timeout")
    if e.code == "unavailable":
        return APIError(503, e.message, "service_unavailable", None, "unavailable")
    return APIError(500, e.message or "the worker failed", "server_error", None, e.code or "internal")


def not_started(request_id: str) -> APIError:
    """A request that ended ``timeout``: no worker started it within its timeout_s."""
    return generation_error(GenerationError("timeout", "no worker started the request within its timeout_s", request_id))


def param_of(message: str) -> str | None:
    """The field a validation message is about (its first word, when that is a field name)."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head in REQUEST_KEYWORDS else None


# What a pydantic error type says about its field.
_PHRASES = {
    "missing": "is required", "bool_type": "must be a boolean", "int_type": "must be an integer",
    "float_type": "must be a number", "string_type": "must be a string", "list_type": "must be an array",
    "dict_type": "must be an object", "model_type": "must be an object",
}


def from_validation(e: ValidationError) -> APIError:
    """The first error of a request model's validation, as a 400 naming its field."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if not loc:
        return bad("the request body must be a JSON object")
    param = loc[0]
    if err["type"] == "value_error":
        return bad(str(err["msg"]).removeprefix("Value error, "), param)
    phrase = _PHRASES.get(err["type"])
    return bad(f"{param} {phrase}" if phrase else f"{param}: {err['msg']}", param)


def install(app: FastAPI) -> None:
    """Every error the app can meet, answered in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(APIError(e.status_code, msg, kind), headers=getattr(e, "headers", None))

    @app.exception_handler(redis.RedisError)
    async def _redis_error(request: Request, e: redis.RedisError) -> JSONResponse:
        log.warning("Redis error: %s", e)
        return error_response(APIError(503, f"the queue (Redis) is unavailable: {type(e).__name__}",
                                       "service_unavailable", None, "unavailable"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal gateway error", "server_error", None, "internal"))
