"""OpenAI's Responses API (``/v1/responses``): gateway mode, OpenAI dialect.

A request with ``code_interpreter`` or ``caronte:code_execution`` is served by
the gateway's tool loop in front of the configured upstream; any other passes
through unchanged. Errors are OpenAI's (``{"error": {...}}`` with
``x-request-id``); an upstream's own error keeps its status.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from shoal.gateway import UpstreamError, UpstreamNotConfigured
from shoal.streaming import StreamingBody
from shoal.gateway.openai import InvalidResponsesRequest, parse_request
from shoal.gateway.upstream import check_forwarded

from ._bodies import key_named_twice, read_json_object
from ._gateway import drain, first_chunk, held, streamed, unless_gone
from ._responses import json_response
from .auth import model_scope, tenant_of
from .errors import OPENAI, BadRequest, error_body, openai_code, request_id_of, stream_failure
from .schemas import (RESPONSE_EVENTS, RESPONSES_ERRORS, ResponseDeleted, ResponseObject,
                      ResponsesRequest, request_body)

router = APIRouter(prefix="/v1/responses", tags=["responses"])
log = logging.getLogger("shoal.gateway")


def upstream_error(request: Request, exc: UpstreamError) -> JSONResponse:
    body = exc.body
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = error_body(OPENAI, exc.status, exc.message)
    return JSONResponse({**body, "request_id": request_id_of(request)}, status_code=exc.status,
                        headers=exc.retry_headers())


@router.post("", summary="Responses, with the code interpreter served here",
             responses={**RESPONSES_ERRORS, 200: {
                 "model": ResponseObject, "content": RESPONSE_EVENTS,
                 "description": "The response; with \"stream\": true, its events"}},
             openapi_extra=request_body(json=ResponsesRequest))
async def create_response(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    gateway = request.app.state.gateway
    body = await read_json_object(request)
    try:
        parsed = parse_request(body)
        if parsed is None and await gateway.holds_conversation(tenant, body):
            parsed = parse_request(body, continuing=True)
    except InvalidResponsesRequest as exc:
        raise BadRequest(400, str(exc), param=exc.param) from None
    check_forwarded("openai", request.headers)
    try:
        upstream = gateway.upstream("openai")
    except UpstreamNotConfigured as exc:
        raise BadRequest(501, str(exc)) from None
    if parsed is None:
        guarded = gateway.passed.shared or model_scope(request) is not None
        twice = key_named_twice(await request.body()) if guarded else None
        if twice is not None:
            # Passed on as sent: the upstream's parser might take the value the
            # checks below did not see (previous_response_id, an item's id).
            raise BadRequest(400, f"the body names {twice!r} twice in one object")
        if body.get("conversation") is not None and guarded:
            raise BadRequest(400, "conversation is not served here: the upstream's "
                                  "conversations are the operator's, whoever made them; "
                                  "continue a response with previous_response_id",
                             param="conversation")
        await gateway.passed.check(tenant, model_scope(request), body)
    return await held(gateway, tenant, lambda: _serve(request, tenant, gateway, upstream, parsed,
                                                      body))


async def _serve(request: Request, tenant: str, gateway, upstream, parsed,
                 body: dict) -> Response:
    if parsed is None:
        try:
            answer = await unless_gone(request, upstream.forward(request, "/v1/responses",
                                                                 await request.body()))
        except UpstreamError as exc:
            return upstream_error(request, exc)
        return await gateway.passed.noted(answer, tenant, model_scope(request), body)
    headers = {k.lower(): v for k, v in request.headers.items()}
    session = await gateway.prepare_responses(tenant, parsed, headers, scope=model_scope(request))
    events = session.events()
    if not parsed.stream:
        try:
            await unless_gone(request, drain(events))
        except UpstreamError as exc:
            return upstream_error(request, exc)
        return json_response(session.adapter.response(),
                             headers={"server-timing": session.loop.timing.server_timing()})
    iterator = events.__aiter__()
    try:
        first = await unless_gone(request, first_chunk(iterator))
    except UpstreamError as exc:
        return upstream_error(request, exc)
    return StreamingBody(streamed(first, iterator, lambda exc: _failure(exc, session)),
                         media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _failure(exc: Exception, session) -> list[bytes]:
    """Past the first event the status is sent: what a handler would have answered
    (a quota, capacity, a container gone) travels in OpenAI's failure events."""
    if isinstance(exc, UpstreamError):
        status, message = exc.status, exc.message
        log.warning("a streamed response failed: %s", message, extra={"status": status})
    else:
        status, message = stream_failure(exc, "a streamed response")
    return session.adapter.failure(message, openai_code(status))


@router.get("/{response_id}", summary="A stored response",
            responses={**RESPONSES_ERRORS,
                       200: {"model": ResponseObject, "description": "The response"}})
async def get_response(response_id: str, request: Request,
                       tenant: str = Depends(tenant_of)) -> Response:
    return json_response(await request.app.state.gateway.stored_response(tenant, response_id))


@router.delete("/{response_id}", summary="Forget a stored response",
               responses={**RESPONSES_ERRORS,
                          200: {"model": ResponseDeleted, "description": "Forgotten"}})
async def delete_response(response_id: str, request: Request,
                          tenant: str = Depends(tenant_of)) -> Response:
    gateway = request.app.state.gateway
    if not await gateway.delete_response(tenant, response_id):
        raise BadRequest(404, f"No response with id '{response_id}' found.")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
