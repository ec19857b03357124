"""Every error the app answers, in OpenAI's JSON shape with ``param`` naming the field: the
exception handlers ``build_app`` installs, one per kind of failure."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.server.asgi_guards import error_body
from deepinfer.server.async_llm import (
    EngineAsleepError,
    QueueFullError,
    RequestFailedError,
    ShuttingDownError,
)
from deepinfer.server.protocol import RequestError


def error_response(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(status, message, param, kind), status_code=status, headers=headers)


async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {}
    if err.get("type") == "json_invalid":  # its loc is a byte offset, not a field
        return error_response(400, f"body: invalid JSON ({err.get('msg', '')})", "body")
    param = _loc_param(err.get("loc", ()))
    return error_response(400, f"{param or 'body'}: {err.get('msg', 'invalid request')}", param)


async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # unknown routes, wrong methods, bodies FastAPI could not parse (bad UTF-8, nesting
    # too deep for the JSON decoder)
    param = "body" if exc.status_code == 400 else None
    response = error_response(exc.status_code, str(exc.detail), param)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc.code, str(exc), exc.param)


async def _failed(_request: Request, exc: RequestFailedError) -> JSONResponse:
    return error_response(500, f"this request failed in the engine: {exc}")


async def _shutting_down(_request: Request, exc: ShuttingDownError | EngineAsleepError) -> JSONResponse:
    return error_response(503, str(exc))


async def _internal(_request: Request, exc: Exception) -> JSONResponse:  # e.g. an engine step that failed
    return error_response(500, f"{type(exc).__name__}: {exc}")


async def _queue_full(_request: Request, exc: QueueFullError) -> JSONResponse:
    return error_response(429, str(exc))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestFailedError, _failed)
    app.add_exception_handler(ShuttingDownError, _shutting_down)
    app.add_exception_handler(EngineAsleepError, _shutting_down)
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(QueueFullError, _queue_full)


# the names pydantic puts in an error's location for the member of a union that failed
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}


def _loc_param(loc: tuple | list) -> str | None:
    """A validation error's location as the field path check_body writes (``messages[0].content``):
    list indices in brackets, without ``body`` or the union member pydantic tried."""
    param = ""
    for part in loc:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _UNION_MEMBERS or "[" in str(part) or "-" in str(part):
            continue
        else:
            param += f".{part}" if param else str(part)
    return param or None
