"""Anthropic's Messages API (``/v1/messages``): gateway mode, Anthropic dialect.

A request with a code-execution tool is served by the gateway's tool loop in
front of the configured upstream model; any other request passes through to
that upstream unchanged. Errors are Anthropic's (``{"type": "error", "error":
{...}}`` with ``request-id``); an upstream's own error keeps its status.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from shoal.gateway import UpstreamError, UpstreamNotConfigured
from shoal.streaming import StreamingBody
from shoal.gateway.anthropic import InvalidMessagesRequest, parse_request
from shoal.gateway.upstream import check_forwarded

from ._bodies import read_json_object
from ._gateway import drain, first_chunk, held, streamed, unless_gone
from ._responses import json_response
from .auth import model_scope, tenant_of
from .errors import ANTHROPIC, BadRequest, error_body, request_id_of, stream_failure
from .schemas import (MESSAGE_EVENTS, MESSAGES_ERRORS, Message, MessagesRequest,
                      MessagesValidation, request_body)

router = APIRouter(tags=["messages"])


async def _body(request: Request) -> dict:
    try:
        return await read_json_object(request)
    except BadRequest as exc:  # Anthropic calls a body it cannot read a 400
        raise BadRequest(400, exc.detail) from None


def _parsed(body: dict):
    try:
        return parse_request(body)
    except InvalidMessagesRequest as exc:
        raise BadRequest(400, str(exc)) from None


def upstream_error(request: Request, exc: UpstreamError) -> JSONResponse:
    """The upstream's error, with its status: its own body if it is Anthropic's."""
    body = exc.body
    if not (isinstance(body, dict) and body.get("type") == "error"
            and isinstance(body.get("error"), dict)):
        body = error_body(ANTHROPIC, exc.status, exc.message)
    body = {**body, "request_id": request_id_of(request)}
    return JSONResponse(body, status_code=exc.status, headers=exc.retry_headers())


def _not_configured(exc: UpstreamNotConfigured) -> BadRequest:
    return BadRequest(501, str(exc))


@router.post("/v1/messages", summary="Messages, with Anthropic's code-execution tool served here",
             responses={**MESSAGES_ERRORS, 200: {
                 "model": Message, "content": MESSAGE_EVENTS,
                 "description": "The message; with \"stream\": true, its events"}},
             openapi_extra=request_body(json=MessagesRequest))
async def create_message(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    gateway = request.app.state.gateway
    body = await _body(request)
    parsed = _parsed(body)
    check_forwarded("anthropic", request.headers)
    try:
        upstream = gateway.upstream("anthropic")
    except UpstreamNotConfigured as exc:
        raise _not_configured(exc) from None
    return await held(gateway, tenant, lambda: _serve(request, tenant, gateway, upstream, parsed))


async def _serve(request: Request, tenant: str, gateway, upstream, parsed) -> Response:
    if parsed is None:
        try:
            return await unless_gone(request, upstream.forward(request, "/v1/messages",
                                                               await request.body()))
        except UpstreamError as exc:
            return upstream_error(request, exc)
    headers = {k.lower(): v for k, v in request.headers.items()}
    adapter, loop = await gateway.prepare_messages(tenant, parsed, headers,
                                                   scope=model_scope(request))
    events = loop.events()
    if not parsed.stream:
        try:
            await unless_gone(request, drain(events))
        except UpstreamError as exc:
            return upstream_error(request, exc)
        return json_response(adapter.message(),
                             headers={"server-timing": loop.timing.server_timing()})
    iterator = events.__aiter__()
    try:
        first = await unless_gone(request, first_chunk(iterator))
    except UpstreamError as exc:
        return upstream_error(request, exc)
    request_id = request_id_of(request)
    return StreamingBody(streamed(first, iterator, lambda exc: [_failure(exc, request_id)]),
                         media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _failure(exc: Exception, request_id: str | None) -> bytes:
    """Mid-stream the status is sent: the error travels as Anthropic's error event."""
    if isinstance(exc, UpstreamError):
        body = exc.body if isinstance(exc.body, dict) and exc.body.get("type") == "error" else (
            error_body(ANTHROPIC, exc.status, exc.message))
        return _event("error", {**body, "request_id": request_id})
    return _event("error", error_body(ANTHROPIC, *stream_failure(exc, "a streamed message"),
                                      request_id))


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@router.post("/v1/messages/validate",
             summary="Check a Messages request; run nothing, call no model",
             responses={**MESSAGES_ERRORS, 200: {"model": MessagesValidation,
                                                 "description": "The request is valid"}},
             openapi_extra=request_body(json=MessagesRequest))
async def validate_message(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    gateway = request.app.state.gateway
    body = await _body(request)
    parsed = _parsed(body)
    configured = True
    try:
        gateway.upstream("anthropic")
    except UpstreamNotConfigured:
        configured = False
    answer = {"type": "validation", "valid": True, "code_execution": parsed is not None,
              "upstream_configured": configured}
    if parsed is not None:
        await gateway.prepare_messages(tenant, parsed, {}, run=False)
        answer.update(mode=parsed.mode, upstream_tools=list(parsed.code_tools),
                      container=parsed.container_id, skills=parsed.skills or [],
                      stream=parsed.stream)
    return json_response(answer)
