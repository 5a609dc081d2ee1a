"""Every error leaves as JSON ``{"detail": ...}`` with the status that fits it.

Domain errors from the layers below are mapped here, once, so no router has to
remember that an unknown session is a 404 or a full house a 503; anything not
mapped is a bug, logged with its traceback and answered with a bare 500.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from pydantic import BaseModel
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shoal.sandbox.launcher import LaunchFailed
from shoal.sessions import (AtCapacity, CallTooLarge, FileAccessError, InvalidContainer, SandboxClosed,
                            UnknownContainer, UnknownSession)

log = logging.getLogger("shoal.api")


class ErrorBody(BaseModel):
    """Every error's body: what went wrong, as text or as a list of problems."""

    detail: str | list | dict


# Declared on every router, so the served OpenAPI document says what errors
# really look like (FastAPI's default 422 schema is not ours).
ERROR_RESPONSES = {status: {"model": ErrorBody, "description": description} for status, description in (
    (400, "Bad request"), (401, "Missing or invalid token"), (403, "Path outside the files"),
    (404, "Not found"), (413, "Too large"), (422, "Malformed request"), (503, "At capacity"),
    (507, "Disk quota full"))}


class BadRequest(Exception):
    """A request the server understood but refuses; carries its status."""

    def __init__(self, status: int, detail: object) -> None:
        super().__init__(str(detail))
        self.status = status
        self.detail = detail


def error_response(status: int, detail: object, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class ShutdownGuard:
    """ASGI middleware: a call still running when the shutdown grace period ends
    is cancelled by the server; it gets a JSON 503, not a bare 500."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            response = error_response(503, "the server is shutting down; the call was stopped")
            await response(scope, receive, send)


def install(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        return error_response(422, errors)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        return error_response(exc.status, exc.detail)

    @app.exception_handler(UnknownSession)
    async def _unknown(request: Request, exc: UnknownSession):
        return error_response(404, str(exc))

    @app.exception_handler(UnknownContainer)
    async def _unknown_container(request: Request, exc: UnknownContainer):
        return error_response(404, str(exc))

    @app.exception_handler(InvalidContainer)
    async def _invalid_container(request: Request, exc: InvalidContainer):
        return error_response(422, str(exc))

    @app.exception_handler(SandboxClosed)
    async def _closed(request: Request, exc: SandboxClosed):
        return error_response(404, "the session was released while the call ran")

    @app.exception_handler(CallTooLarge)
    async def _too_large(request: Request, exc: CallTooLarge):
        return error_response(413, "the call's input is too large to run")

    @app.exception_handler(AtCapacity)
    async def _capacity(request: Request, exc: AtCapacity):
        return error_response(503, str(exc), {"Retry-After": "1"})

    @app.exception_handler(LaunchFailed)
    async def _launch(request: Request, exc: LaunchFailed):
        log.error("sandbox launch failed: %s", exc)
        return error_response(503, "no sandbox could be started; retry later")

    @app.exception_handler(FileAccessError)
    async def _files(request: Request, exc: FileAccessError):
        return error_response(exc.status, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error")
