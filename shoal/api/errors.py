"""Every error leaves in its dialect's own shape, with the status that fits it.

Domain errors from the layers below are mapped here, once, so no router has to
remember that an unknown session is a 404 or a full house a 503; anything not
mapped is a bug, logged once with its traceback and answered with a 500
(:class:`shoal.api.observability.Edge`).

Which shape an error takes is decided by the request, not by the error:

- protocol v1 and Zylon's Files API (``scope_id``): ``{"detail": ...}``;
- OpenAI's dialect (``/v1/responses``, ``/v1/containers``, the runs API, the
  tenant Files API): ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic's (``/v1/messages``, and the Files API when the client sends
  ``anthropic-version``): ``{"type": "error", "error": {"type", "message"}}``.

Every body also carries the request id, which the response echoes in
``x-request-id`` and ``request-id``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from shoal.gateway import UpstreamError, UpstreamNotConfigured
from shoal.gateway.anthropic import InvalidMessagesRequest
from shoal.gateway.openai import InvalidResponsesRequest
from shoal.gateway.passed import NotThisSandbox, NotYours
from shoal.gateway.service import OutOfScope, UnknownResponse
from shoal.gateway.upstream import UnsendableHeader
from shoal.runs import CallbackNotAllowed, InvalidTools, RunConflict, UnknownRun, UnknownToolCall
from shoal.sandbox import DiskFull, PoolBusy, UidsExhausted
from shoal.sandbox.launcher import LaunchFailed
from shoal.sessions import (AtCapacity, CallTooLarge, ContainerElsewhere, FileAccessError,
                            InvalidContainer,
                            SandboxClosed, StoreUnavailable, TenantQuotaExceeded, UnknownContainer,
                            UnknownSession)

# A sandbox host's 421 names the host that holds the container (cluster mode).
PLACEMENT_HEADER = "shoal-placement"

log = logging.getLogger("shoal.api")

PROTOCOL, OPENAI, ANTHROPIC = "protocol", "openai", "anthropic"
_OPENAI_PREFIXES = ("/v1/responses", "/v1/containers", "/v1/code-execution", "/v1/runtime")
_ANTHROPIC_PREFIXES = ("/v1/messages",)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "permission_error", 404: "invalid_request_error", 409: "conflict_error",
                 413: "invalid_request_error", 422: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error", 507: "insufficient_storage"}
_OPENAI_CODES = {401: "invalid_api_key", 404: "not_found", 409: "conflict",
                 413: "request_too_large", 429: "rate_limit_exceeded", 503: "service_unavailable",
                 507: "quota_exceeded"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 409: "conflict_error",
                    413: "request_too_large", 422: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    507: "invalid_request_error", 529: "overloaded_error"}


class ErrorBody(BaseModel):
    """Every protocol error's body: what went wrong, as text or as a list of problems."""

    detail: str | list | dict


# Declared on every router, so the served OpenAPI document says what errors
# really look like (FastAPI's default 422 schema is not ours).
ERROR_RESPONSES = {status: {"model": ErrorBody, "description": description} for status, description in (
    (400, "Bad request"), (401, "Missing or invalid token"), (403, "Path outside the files"),
    (404, "Not found"), (413, "Too large"), (422, "Malformed request"), (503, "At capacity"),
    (507, "Disk quota full"))}


class BadRequest(Exception):
    """A request the server understood but refuses; carries its status."""

    def __init__(self, status: int, detail: object, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(str(detail))
        self.status = status
        self.detail = detail
        self.param = param
        self.code = code


def dialect_of(request: Request) -> str:
    path = request.url.path
    for prefix in ("/api/gpt", ""):  # Zylon's prefix is an alias of the same routes
        if path.startswith(prefix + "/"):
            rest = path[len(prefix):]
            if rest.startswith(_ANTHROPIC_PREFIXES):
                return ANTHROPIC
            if rest.startswith(_OPENAI_PREFIXES):
                return OPENAI
            if rest.startswith("/v1/files"):
                if "scope_id" in request.query_params:
                    return PROTOCOL
                return ANTHROPIC if "anthropic-version" in request.headers else OPENAI
    return PROTOCOL


def _message(detail: object) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg', d)}"
                         if isinstance(d, dict) else str(d) for d in detail)
    return str(detail)


def openai_code(status: int) -> str:
    """The ``code`` of OpenAI's error object for a status."""
    return _OPENAI_CODES.get(status) or ("invalid_request" if status < 500 else "server_error")


def error_body(dialect: str, status: int, detail: object, request_id: str | None = None,
               param: str | None = None, code: str | None = None) -> dict:
    if dialect == OPENAI:
        body = {"error": {"message": _message(detail),
                          "type": _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500
                                                    else "server_error"),
                          "param": param, "code": code or _OPENAI_CODES.get(status)}}
    elif dialect == ANTHROPIC:
        # Any other 4xx (a 405, a 408) is the client's to fix, not the server's.
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        body = {"type": "error", "error": {"type": kind,
                                           "message": _message(detail)}}
    else:
        body = {"detail": detail}
    if request_id:
        body["request_id"] = request_id
    return body


def _openais_own(request: Request) -> bool:
    """An API OpenAI itself serves (Responses, Containers, Files), not Caronte's."""
    path = request.url.path
    return "/v1/code-execution" not in path and "/v1/runtime" not in path


def request_id_of(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def error_response(request: Request | None, status: int, detail: object,
                   headers: dict | None = None, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    dialect = dialect_of(request) if request is not None else PROTOCOL
    request_id = request_id_of(request) if request is not None else None
    if status == 422 and (dialect == ANTHROPIC or (dialect == OPENAI and _openais_own(request))):
        # Anthropic and OpenAI answer every malformed request with a 400 (their
        # SDKs raise BadRequestError for it); Caronte's run API keeps its 422.
        status = 400
    if status == 503 or status == 429:
        headers = {"Retry-After": "1", **(headers or {})}
    return JSONResponse(error_body(dialect, status, detail, request_id, param, code),
                        status_code=status, headers=headers)


# The failures a stream that has begun can still name (its status is sent): an
# exception type, its status, and the message if not the exception's own.
_KNOWN: dict[type, tuple[int, str | None]] = {}
# Those of them that are a resource running out, which the operator hears of.
_EXHAUSTED: set[type] = set()


def known_failure(exc: BaseException) -> tuple[int, str] | None:
    """The status and words a handler gives ``exc``, or None for a server bug."""
    for kind in type(exc).__mro__:
        if kind in _KNOWN:
            status, message = _KNOWN[kind]
            return status, message or str(exc)
    return None


def stream_failure(exc: BaseException, what: str) -> tuple[int, str]:
    """The status and words a stream that has begun ends with for ``exc``, logged
    as its JSON answer would be: a resource that ran out as a warning, a client's
    mistake at info (it costs no line at the default level, streamed or not),
    anything else as the bug it is (its words are not the client's to see)."""
    known = known_failure(exc)
    if known is None:
        log.error("%s failed mid-stream", what, exc_info=exc)
        return 500, "internal error"
    level = logging.WARNING if isinstance(exc, tuple(_EXHAUSTED)) else logging.INFO
    log.log(level, "%s failed: %s", what, known[1], extra={"status": known[0]})
    return known


def install(app: FastAPI) -> None:
    def handler(exception: type, status: int | None = None, message: str | None = None):
        if status is not None:
            _KNOWN[exception] = (status, message)

        def register(function=None):
            async def render(request: Request, exc: Exception):
                if function is not None:
                    return function(request, exc)
                return error_response(request, status, message or str(exc))
            app.add_exception_handler(exception, render)
            return function
        return register

    @handler(HTTPException)
    def _http(request: Request, exc: HTTPException):
        return error_response(request, exc.status_code, exc.detail, getattr(exc, "headers", None))

    @handler(RequestValidationError)
    def _validation(request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        param = ".".join(map(str, errors[0]["loc"][1:])) if errors and errors[0]["loc"] else None
        return error_response(request, 422, errors, param=param or None)

    @handler(BadRequest)
    def _bad_request(request: Request, exc: BadRequest):
        return error_response(request, exc.status, exc.detail, param=exc.param, code=exc.code)

    handler(UnknownSession, 404)()
    # A client that hung up mid-body hears nothing; the answer (and the access log
    # and metrics) must still say it was the client's doing, not the server's bug.
    handler(ClientDisconnect, 400, "the client hung up before the body was complete")()
    # The routers turn these into 400s where they parse; a check that runs later
    # (preparing the loop) must not make the client's mistake a 500.
    handler(InvalidMessagesRequest, 400)()

    @handler(InvalidResponsesRequest)
    def _responses_request(request: Request, exc: InvalidResponsesRequest):
        return error_response(request, 400, str(exc), param=exc.param)

    handler(UnknownContainer, 404)()

    @handler(ContainerElsewhere)
    def _elsewhere(request: Request, exc: ContainerElsewhere):
        # Only a cluster front end sends requests to a sandbox host, and it takes
        # this answer to resend the request to the holder; a client never sees it.
        return error_response(request, 421, str(exc), {PLACEMENT_HEADER: exc.host})
    handler(UnknownRun, 404)()
    handler(UnknownToolCall, 404)()
    handler(UnknownResponse, 404)()
    handler(NotYours, 404)()
    handler(OutOfScope, 403)()
    handler(NotThisSandbox, 403)()
    handler(RunConflict, 409)()
    handler(InvalidContainer, 422)()
    handler(InvalidTools, 422)()
    handler(CallbackNotAllowed, 403)()
    handler(SandboxClosed, 404, "the session ended while the call ran: it was released, or "
                                "its container was deleted")()
    handler(CallTooLarge, 413, "the call's input is too large to run")()
    def exhausted(exception: type, status: int, message: str | None = None):
        """A resource ran out: the client is told to come back (Retry-After), and the
        operator is told at WARNING, since it means the server is too small."""
        def render(request: Request, exc: Exception):
            log.warning("refused a request: %s", exc,
                        extra={"resource": type(exc).__name__, "status": status})
            return error_response(request, status, message or str(exc))
        handler(exception)(render)
        _KNOWN[exception] = (status, message)
        _EXHAUSTED.add(exception)

    exhausted(AtCapacity, 503)
    exhausted(PoolBusy, 503)
    exhausted(UidsExhausted, 503)
    exhausted(TenantQuotaExceeded, 429)
    exhausted(DiskFull, 503, "the server's disk cannot back another sandbox now; retry later")
    exhausted(StoreUnavailable, 503)
    handler(UpstreamNotConfigured, 501)()
    handler(UnsendableHeader, 400)()

    @handler(UpstreamError)
    def _upstream(request: Request, exc: UpstreamError):
        return error_response(request, exc.status, exc.message, exc.retry_headers())

    @handler(LaunchFailed)
    def _launch(request: Request, exc: LaunchFailed):
        return error_response(request, 503, "no sandbox could be started; retry later")

    @handler(FileAccessError)
    def _files(request: Request, exc: FileAccessError):
        return error_response(request, exc.status, str(exc))
    # Anything else is a bug: observability.Edge logs it once and answers 500.
