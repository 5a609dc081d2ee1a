"""Caronte's direct run API (``/v1/code-execution/runs``): runs over SSE.

``POST`` starts a run and answers a ``text/event-stream`` of its events:
``run.created`` at once, ``run.output`` while it prints (Shoal's additive
event), ``tool_call.required`` when its code calls the client's tools,
``run.completed`` or ``run.failed``, then ``data: [DONE]``. Every event has an
``id``; ``GET .../events`` with ``Last-Event-ID`` replays from there, so a
client that lost the stream loses nothing. The run itself never depends on a
connection: it finishes whoever listens.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request, Response
from sse_starlette import ServerSentEvent

from shoal.runs import (DEFAULT_TIMEOUT_MS, LANGUAGES, MAX_TIMEOUT_MS, EventLog, InvalidTools,
                        RunManager, RunRequest, normalise_tool)

from shoal.sandbox.toolcalls import MAX_RESULT_BYTES

from ._bodies import distinct_file_ids, read_json_object
from ._sse import EventStream, chunks
from ._responses import json_response
from .auth import tenant_of
from .errors import BadRequest
from .schemas import (RUN_EVENTS, RUNS_ERRORS, RunRecord, StartRun, SubmitToolResults,
                      ToolResultsAccepted, request_body)

router = APIRouter(prefix="/v1/code-execution/runs", tags=["runs"])


def _runs(request: Request) -> RunManager:
    return request.app.state.runs


def parse_run(body: dict) -> RunRequest:
    language = body.get("language", "python")
    if language not in LANGUAGES:
        raise BadRequest(422, f"language must be one of {', '.join(LANGUAGES)}", param="language")
    code = body.get("code")
    if not isinstance(code, str) or not code.strip():
        raise BadRequest(422, "code is required and must be a non-empty string", param="code")
    # Absent or null is none; {} or 0 is a mistake to point out, not "none".
    raw_tools = body.get("tools")
    raw_tools = [] if raw_tools is None else raw_tools
    if not isinstance(raw_tools, list):
        raise BadRequest(422, "tools must be a list of function tools", param="tools")
    try:
        tools = [normalise_tool(tool) for tool in raw_tools]
    except InvalidTools as exc:
        raise BadRequest(422, str(exc), param="tools") from None
    allowed = body.get("allowed_tools")
    allowed = [] if allowed is None else allowed
    if not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed):
        raise BadRequest(422, "allowed_tools must be a list of tool names", param="allowed_tools")
    undeclared = sorted(set(allowed) - {tool.name for tool in tools})
    if undeclared:
        raise BadRequest(422, "allowed_tools names tools that are not declared: "
                              + ", ".join(map(repr, undeclared)), param="allowed_tools")
    container = body.get("container", body.get("container_id"))
    if container is not None and (not isinstance(container, str) or not container):
        raise BadRequest(422, "container must be a container id", param="container")
    file_ids = body.get("file_ids")
    file_ids = [] if file_ids is None else file_ids
    if not isinstance(file_ids, list) or not all(isinstance(f, str) and f for f in file_ids):
        raise BadRequest(422, "file_ids must be a list of file ids", param="file_ids")
    file_ids = distinct_file_ids(file_ids)
    timeout_ms = body.get("timeout_ms", DEFAULT_TIMEOUT_MS)
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 1:
        raise BadRequest(422, "timeout_ms must be a positive integer", param="timeout_ms")
    return RunRequest(language=language, code=code, tools=tools, allowed_tools=allowed,
                      container_id=container, file_ids=file_ids,
                      timeout_ms=min(timeout_ms, MAX_TIMEOUT_MS))


async def _stream(log: EventLog, after: int, ping: float) -> AsyncIterator[bytes]:
    """The log's events after ``after``, in bounded chunks (``chunks``), then the
    live ones until it ends; ``[DONE]`` rides with the last chunk."""
    last_id = after
    async for batch in log.follow_batches(after, ping):
        if not batch:
            yield b""  # a quiet log: the stream pings
            continue
        last_id = batch[-1].id
        ended = log.closed  # then this batch holds the run's end
        pieces = chunks(batch)
        chunk = next(pieces)
        for following in pieces:
            yield chunk
            chunk = following
        if ended:
            yield chunk + _done(last_id)
            return
        yield chunk
    yield _done(last_id)


def _done(last_id: int) -> bytes:
    return ServerSentEvent("[DONE]", id=str(last_id + 1)).encode()


def _following(log: EventLog, after: int, request: Request) -> EventStream:
    return EventStream(_stream(log, after, request.app.state.settings.stream_ping_seconds))


@router.post("", summary="Start a run; its events as server-sent events",
             response_class=Response,
             responses={**RUNS_ERRORS, 200: {"content": RUN_EVENTS, "description": (
                 "The run's events, from run.created to [DONE]")}},
             openapi_extra=request_body(json=StartRun))
async def start_run(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    run = await _runs(request).start(tenant, parse_run(await read_json_object(request)))
    return _following(run.log, 0, request)


@router.get("/{run_id}", summary="A run's record (the tool result shape)",
            responses={**RUNS_ERRORS, 200: {"model": RunRecord, "description": "The record"}})
async def get_run(run_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    return json_response(await _runs(request).record(tenant, run_id))


@router.get("/{run_id}/events", summary="Replay a run's events, then follow it",
            response_class=Response,
            responses={**RUNS_ERRORS, 200: {"content": RUN_EVENTS, "description": (
                "The events after Last-Event-ID (or after=), then the live ones")}})
async def run_events(run_id: str, request: Request,
                     after: str | None = Query(None, pattern="^[0-9]+$", description=(
                         "An event id (as Last-Event-ID): the events after it")),
                     tenant: str = Depends(tenant_of)) -> Response:
    if after is not None:
        position = _event_id(after, "after")
    else:
        position = _event_id(request.headers.get("last-event-id"), "Last-Event-ID")
    log = await _runs(request).events(tenant, run_id)
    # No event has an id past the log's end: such an id means the end, so the
    # stream gives what comes next (a live run's) or [DONE] with its own id.
    return _following(log, min(position, log.last_id), request)


# Past the end of any log: digits beyond these are not read (int() refuses
# more than 4300 of them, and reading that many is work for nothing).
_PAST_ANY_END = 10**18


def _event_id(value: str | None, param: str) -> int:
    """An id a reconnecting client sends back: none (or empty) is the start,
    any run of ASCII digits an id (one past the end is the end); anything else
    is not an id this server sent."""
    if not value:
        return 0
    if not (value.isascii() and value.isdigit()):
        raise BadRequest(422, f"{param} must be the id of one of the run's events, a "
                         "non-negative integer", param=param)
    digits = value.lstrip("0") or "0"
    return int(digits) if len(digits) < len(str(_PAST_ANY_END)) else _PAST_ANY_END


@router.post("/{run_id}/tool-results", summary="Answer the run's waiting tool calls",
             responses={**RUNS_ERRORS,
                        200: {"model": ToolResultsAccepted, "description": "Accepted"}},
             openapi_extra=request_body(json=SubmitToolResults))
async def tool_results(run_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    body = await read_json_object(request)
    results = body.get("results")
    if not isinstance(results, list) or not results:
        raise BadRequest(422, "results must be a non-empty list of {call_id, output}",
                         param="results")
    parsed = []
    for entry in results:
        if not isinstance(entry, dict) or not isinstance(entry.get("call_id"), str):
            raise BadRequest(422, "each result needs a call_id", param="results")
        error = entry.get("error")
        if error is not None and not isinstance(error, str):
            raise BadRequest(422, "a result's error must be a string", param="results")
        if error is None and entry.get("is_error"):
            error = entry.get("output") if isinstance(entry.get("output"), str) else "tool error"
        if _size(entry.get("output")) > MAX_RESULT_BYTES or _size(error) > MAX_RESULT_BYTES:
            # It could not reach the code in one frame: refused here, where the
            # client can still act on it, not accepted and then lost.
            raise BadRequest(413, f"a tool result may be at most {MAX_RESULT_BYTES} bytes "
                                  "as JSON", param="results")
        parsed.append({"call_id": entry["call_id"], "output": entry.get("output"), "error": error})
    accepted = await _runs(request).submit(tenant, run_id, parsed)
    return json_response({"run_id": run_id, "accepted": accepted})


def _size(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 2
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))


@router.delete("/{run_id}", summary="Cancel a run",
               responses={**RUNS_ERRORS,
                          200: {"model": RunRecord, "description": "The cancelled run's record"}})
async def cancel_run(run_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    return json_response(await _runs(request).cancel(tenant, run_id))
