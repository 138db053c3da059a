"""Errors in OpenAI's format (``{"error": {"message", "type", "param", "code"}}``) and the request size limit.

Every bad input ends as a 4xx answer of this shape, never a 500: validation errors, malformed JSON,
unknown routes and oversized bodies included.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["APIError", "BodyLimit", "ErrorResponse", "error_body", "errors", "install_error_handlers"]

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong, and how to fix it")
    type: str = Field(description="OpenAI's error class, e.g. invalid_request_error, rate_limit_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(description="a stable machine-readable code, e.g. invalid_value, queue_full")


class ErrorResponse(BaseModel):
    """Every error answer of the server (OpenAI's format)."""

    error: ErrorDetail


_MEANINGS = {
    400: "the request is malformed or breaks a rule of this endpoint (`error.param` names the field), e.g. a "
         "prompt longer than the model's context",
    401: "the API key is missing or wrong (send `Authorization: Bearer KEY`)",
    403: "admin is disabled: the server was started without an API key",
    404: "no such model, candidate or elite",
    409: "conflict: another switch is in progress, or the candidate is not ok",
    413: "the request body is larger than the server accepts",
    422: "the kernel ran and failed on these inputs",
    429: "overloaded: too many requests in flight, or the engine's queue is full; retry later",
    503: "the engine is still loading (or failed to load: see /ready), or the server is shutting down",
    504: "the kernel did not answer in time",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route answering these error statuses, each with the error body."""
    return {s: {"model": ErrorResponse, "description": _MEANINGS[s]} for s in statuses}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    if first.get("type") == "json_invalid":
        return APIError(400, "the body is not valid JSON", code="invalid_json").response()
    where = ".".join(loc) or None
    msg = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return APIError(400, msg, param=where, code="invalid_value").response()


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)).response()


def _api(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


def _internal(request: Request, exc: Exception) -> JSONResponse:
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(Exception, _internal)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413 before the app sees it (chunked too), and one
    that has not arrived whole within ``timeout_s`` (a client that sent less than its Content-Length, and
    waits) 408; either closes the connection."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def _refuse(self, send: Send, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _too_large(self, send: Send) -> None:
        await self._refuse(send, 413, f"request body over {self.max_bytes} bytes", "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(send)
            return
        buffered: list[Message] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:  # read the whole body (at most max_bytes, within timeout_s), then replay it
            try:
                msg = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                await self._refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                   "(less than its Content-Length was sent)", "request_timeout")  # fmt: skip
                return
            buffered.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)
