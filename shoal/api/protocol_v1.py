"""The code-execution protocol, contract version 1 (``/sessions``).

Parses each request by the contract's own rules (an unknown tool kind is a
400, a malformed input a 422, and the text editor's fields are checked per
command), runs it through the sessions layer and renders the internal result
as the contract's envelope: ``{tool_use_id, result_block, execution_time_ms}``
with a ``code_execution_result`` payload, never an error variant.

Additive extensions, which a client that does not ask for them never sees:
``input.language`` (``javascript`` runs on Bun), streaming (``Accept:
text/event-stream`` on exec: ``output`` events, then one ``result`` event with
the usual envelope), and the reference backend's programmatic tools.
"""

from __future__ import annotations

import asyncio
import keyword
import re
import secrets

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from shoal.runs import CallbackTools, EventLog, HostAllowlist, check_callback_url
from shoal.sandbox import StubSpec
from shoal.sessions import ExecResult, Session, SessionManager, guess_mime_type

from ._bodies import read_json_object
from ._sse import EventStream, chunks
from ._responses import file_response, json_response
from ._uploads import read_upload, upload_file_name
from .auth import tenant_of
from .errors import ERROR_RESPONSES, BadRequest, stream_failure
from .schemas import (BINARY, EXEC_EVENTS, PROTOCOL_ERRORS, CreateSessionRequest, ExecRequest,
                      ExecResponse, FileList, FileUploadResult, ProgrammaticToolsRegistered,
                      RegisterProgrammaticTools, SessionHandle, WorkspaceUpload, request_body)

router = APIRouter(responses=ERROR_RESPONSES)

# Contract tool kind -> (sessions-layer tool, result block type)
TOOL_KINDS = {
    "code_execution": ("python", "code_execution_tool_result"),
    "bash_code_execution": ("bash", "bash_code_execution_tool_result"),
    "text_editor_code_execution": ("edit", "text_editor_code_execution_tool_result"),
}
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
LANGUAGES = {"python": "python", "javascript": "javascript"}
_PLATFORM_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLATFORM_TOOLS_MODULE = "_platform_tools"


_json = json_response


def _manager(request: Request) -> SessionManager:
    return request.app.state.manager


def _optional_positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(422, f"{name} must be an integer")
    if value < 1:
        raise BadRequest(422, f"{name} must be at least 1")
    return value


def handle(session: Session) -> dict:
    return {
        "session_id": session.id,
        "idle_timeout_seconds": session.idle_timeout_seconds,
        "max_lifetime_seconds": session.max_lifetime_seconds,
        "created_at": session.created_at,
        "last_activity_at": session.last_activity_at,
        "expires_at": min(session.last_activity_at + session.idle_timeout_seconds,
                          session.created_at + session.max_lifetime_seconds),
        "container_id": session.container.id if session.container is not None else None,
    }


# -- sessions ------------------------------------------------------------------------
@router.post("/sessions", status_code=201, summary="Lease a session",
             responses={**PROTOCOL_ERRORS,
                        201: {"model": SessionHandle, "description": "Session leased"}},
             openapi_extra=request_body(json=CreateSessionRequest, required=False))
async def create_session(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    body = await read_json_object(request, required=False)
    idle = _optional_positive_int(body, "idle_timeout_seconds")
    lifetime = _optional_positive_int(body, "max_lifetime_seconds")
    image = body.get("image") if isinstance(body.get("image"), str) else None
    container = body.get("container")
    if container is not None and not isinstance(container, str):
        raise BadRequest(422, "container must be a string id")
    session = await _manager(request).create(tenant, idle, lifetime, image, container)
    return _json(handle(session), 201)


@router.get("/sessions/{session_id}", summary="The session's handle, refreshed",
            responses={200: {"model": SessionHandle, "description": "The handle"}})
async def get_session(session_id: str, request: Request,
                      tenant: str = Depends(tenant_of)) -> Response:
    return _json(handle(_manager(request).get(tenant, session_id)))


@router.delete("/sessions/{session_id}", status_code=204, summary="Release a session")
async def destroy_session(session_id: str, request: Request,
                          tenant: str = Depends(tenant_of)) -> Response:
    await _manager(request).destroy(tenant, session_id)
    return Response(status_code=204)


# -- exec --------------------------------------------------------------------------------
def parse_exec(body: dict) -> tuple[str, str, dict, int | None, str]:
    """(contract tool kind, sessions tool, payload, timeout, tool_use_id) or BadRequest."""
    kind = body.get("tool")
    if kind is None:
        raise BadRequest(422, "tool is required")
    if not isinstance(kind, str):
        raise BadRequest(422, "tool must be a string")
    if kind not in TOOL_KINDS:
        raise BadRequest(400, f"unknown tool kind {kind!r}; expected one of "
                              f"{', '.join(TOOL_KINDS)}")
    tool = TOOL_KINDS[kind][0]
    payload = body.get("input")
    if not isinstance(payload, dict):
        raise BadRequest(422, "input must be a JSON object")
    timeout = _optional_positive_int(body, "timeout_seconds")
    tool_use_id = body.get("tool_use_id")
    if tool_use_id is not None and not isinstance(tool_use_id, str):
        raise BadRequest(422, "tool_use_id must be a string")
    if not tool_use_id:
        tool_use_id = "srvtoolu_" + secrets.token_hex(12)
    if tool == "python":
        _require_text(payload, "code", kind)
        language = payload.get("language", "python")
        if not isinstance(language, str) or language not in LANGUAGES:
            raise BadRequest(422, f"input.language must be one of {', '.join(LANGUAGES)}")
        tool = LANGUAGES[language]
    elif tool == "bash":
        _require_text(payload, "command", kind)
    else:
        _check_editor_input(payload)
    return kind, tool, payload, timeout, tool_use_id


def _require_text(payload: dict, field: str, kind: str, allow_empty: bool = False) -> None:
    value = payload.get(field)
    if not isinstance(value, str) or (not allow_empty and not value):
        raise BadRequest(422, f"input.{field} is required for {kind} and must be a "
                              f"{'string' if allow_empty else 'non-empty string'}")


def _check_editor_input(payload: dict) -> None:
    command = payload.get("command")
    if command not in EDITOR_COMMANDS:
        raise BadRequest(422, f"input.command must be one of {', '.join(EDITOR_COMMANDS)}")
    kind = f"text_editor_code_execution {command}"
    _require_text(payload, "path", kind)
    if command == "create":
        _require_text(payload, "file_text", kind, allow_empty=True)
    elif command == "str_replace":
        _require_text(payload, "old_str", kind)
        _require_text(payload, "new_str", kind, allow_empty=True)
    elif command == "insert":
        line = payload.get("insert_line")
        if isinstance(line, bool) or not isinstance(line, int):
            raise BadRequest(422, f"input.insert_line is required for {kind} and must be an integer")
        text = payload.get("new_str", payload.get("insert_text"))
        if not isinstance(text, str):
            raise BadRequest(422, f"input.new_str (or insert_text) is required for {kind}")
    view_range = payload.get("view_range")
    if view_range is not None and not (
            isinstance(view_range, list) and len(view_range) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)):
        raise BadRequest(422, "input.view_range must be a list of two integers")


def render_exec(kind: str, tool_use_id: str, result: ExecResult) -> dict:
    block_type = TOOL_KINDS[kind][1]
    return {
        "tool_use_id": tool_use_id,
        "result_block": {
            "type": block_type,
            "tool_use_id": tool_use_id,
            "content": {
                "type": "code_execution_result",
                "stdout": result.stdout,
                "stderr": result.stderr,
                "return_code": result.return_code,
                "content": [{"type": "code_execution_output", "file_id": f.file_id,
                             "filename": f.filename} for f in result.files],
            },
        },
        "execution_time_ms": result.execution_time_ms,
        "limits": [limit.value for limit in result.limits],
        "interpreter_restarted": result.restarted,
    }


@router.post("/sessions/{session_id}/exec", summary="Run one tool call in a session",
             responses={200: {"model": ExecResponse, "content": EXEC_EVENTS, "description": (
                 "The call ran (a program that failed too: see return_code and stderr); "
                 "with Accept: text/event-stream, its events")}},
             openapi_extra=request_body(json=ExecRequest))
async def execute(session_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    session = _manager(request).get(tenant, session_id)
    kind, tool, payload, timeout, tool_use_id = parse_exec(await read_json_object(request))
    if "text/event-stream" in request.headers.get("accept", ""):
        # Refused while it can still be a status (the call itself checks again).
        session.check_room()
        return _streamed_exec(request, session, kind, tool, payload, timeout, tool_use_id)
    result = await session.run(tool, payload, timeout)
    request.app.state.metrics.observe_exec(kind, result)
    return _json(render_exec(kind, tool_use_id, result))


def _streamed_exec(request: Request, session: Session, kind: str, tool: str, payload: dict,
                   timeout: int | None, tool_use_id: str) -> Response:
    """The call runs on its own; the stream follows its events: ``output`` as it
    prints, then ``result`` carrying exactly the envelope the JSON answer would.
    A client that goes away stops nothing (the call's effects are the session's)."""
    # A run's budget: code can send its output a character at a time, each an
    # event; past it output events are left out (the result still carries it all).
    log = EventLog(request.app.state.settings.run_log_bytes)
    metrics = request.app.state.metrics

    async def run() -> None:
        try:
            result = await session.run(
                tool, payload, timeout,
                lambda stream, text: log.append("output", {"stream": stream, "text": text},
                                                bounded=True))
            metrics.observe_exec(kind, result)
            log.append("result", render_exec(kind, tool_use_id, result))
        except Exception as exc:  # noqa: BLE001 - the stream says what happened
            # In the words (and with the status) the JSON answer would have had;
            # anything else is a bug, logged, and not described to the client.
            status, detail = stream_failure(exc, "a streamed exec")
            log.append("error", {"detail": detail, "status": status})
        finally:
            log.close()

    task = asyncio.create_task(run())

    async def written():
        async for batch in log.follow_batches(0, request.app.state.settings.stream_ping_seconds):
            if not batch:
                yield b""  # a quiet log: the stream pings
            for chunk in chunks(batch):
                yield chunk
        await task

    return EventStream(written())


# -- programmatic tools (the reference backend's) ---------------------------------------------
@router.post("/sessions/{session_id}/programmatic-tools/register",
             summary="Give the session's code stubs of tools the host calls back",
             responses={200: {"model": ProgrammaticToolsRegistered,
                              "description": "The stubs are importable"}},
             openapi_extra=request_body(json=RegisterProgrammaticTools))
async def register_programmatic_tools(session_id: str, request: Request,
                                      tenant: str = Depends(tenant_of)) -> Response:
    """``from _platform_tools import name``: each call is POSTed by the host to
    ``callback_url`` (``{call_id, name, input}``, bearer ``token``), only to hosts
    the operator allowed; the sandbox itself has no network."""
    session = _manager(request).get(tenant, session_id)
    body = await read_json_object(request)
    allowlist = HostAllowlist(request.app.state.settings.callback_allow)
    url = check_callback_url(body.get("callback_url"), allowlist)
    token = body.get("token")
    if not isinstance(token, str) or not token:
        raise BadRequest(422, "token is required and must be a non-empty string")
    # It goes out in a header: a line break made httpx refuse it in words that
    # quote it (handed to the code as the call's error), and a letter past ASCII
    # raised where no one answered the call, whose code waited out its limit.
    if not (token.isascii() and token.isprintable()):
        raise BadRequest(422, "token must be printable ASCII: it is sent as a bearer token")
    timeout = body.get("timeout_seconds", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 3600:
        raise BadRequest(422, "timeout_seconds must be a number from 1 to 3600")
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        raise BadRequest(422, "tools must be a non-empty list of {name, doc}")
    specs, names = [], set()
    for tool in tools:
        name = tool.get("name") if isinstance(tool, dict) else None
        if (not isinstance(name, str) or not _PLATFORM_TOOL_NAME.match(name)
                or keyword.iskeyword(name)):
            raise BadRequest(422, f"tool name {name!r} is not a Python identifier")
        if name in names:
            raise BadRequest(422, f"tool name {name!r} is given twice")
        names.add(name)
        doc = tool.get("doc") or ""
        if not isinstance(doc, str):
            raise BadRequest(422, f"tool {name!r}: doc must be a string")
        specs.append({"name": name, "description": doc, "parameters": {"type": "object"}})
    session.stubs = StubSpec(specs, module=PLATFORM_TOOLS_MODULE)
    session.tools = CallbackTools(sorted(names), url, token, float(timeout),
                                  request.app.state.http_client, allowlist)
    return _json({"stub_path": PLATFORM_TOOLS_MODULE, "tool_count": len(specs)})


# -- files ---------------------------------------------------------------------------------
@router.get("/sessions/{session_id}/files/list", summary="Enumerate a session's workspace",
            responses={200: {"model": FileList, "description": "The directory's entries"}})
async def list_files(session_id: str, request: Request, path: str = Query("."),
                     tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    session = manager.get(tenant, session_id)
    async with manager.using_files(session):
        entries = await run_in_threadpool(session.list_files, path or ".")
    return _json({"files": [{"path": e.path.relative, "size_bytes": e.size,
                             "mime_type": e.mime_type, "modified_at": e.modified_at}
                            for e in entries]})


@router.get("/sessions/{session_id}/files", summary="Read one file from the workspace",
            response_class=Response,
            responses={200: {"content": BINARY,
                             "description": "The file's bytes, typed by its name"}})
async def get_file(session_id: str, request: Request, path: str = Query(..., min_length=1),
                   tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    session = manager.get(tenant, session_id)
    async with manager.using_files(session):
        sandbox_path, handle_, size = await run_in_threadpool(session.open_file, path)
    name = sandbox_path.parts[-1]
    return await file_response(handle_, size, name, guess_mime_type(name))


@router.post("/sessions/{session_id}/files", status_code=201,
             summary="Write one file into the workspace",
             responses={201: {"model": FileUploadResult, "description": "File written"}},
             openapi_extra=request_body(multipart=WorkspaceUpload))
async def put_file(session_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    session = manager.get(tenant, session_id)
    upload, fields = await read_upload(request, manager.settings.max_file_bytes)
    try:
        path = fields.get("path") or upload_file_name(upload.filename)
        # The body took a while: the session may have ended meanwhile.
        async with manager.using_files(session):
            sandbox_path, size = await run_in_threadpool(session.write_file, path, upload.file)
    finally:
        await upload.close()
    return _json({"path": sandbox_path.relative, "size_bytes": size}, 201)
