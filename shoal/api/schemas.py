"""The wire shapes of every route, for the served OpenAPI document only.

The routers build their answers as plain dicts and read their bodies by hand
(the contract's statuses need it, and so does speed), so FastAPI cannot see
what goes over the wire. These models say it. Nothing validates or serialises
through them at run time: the route decorators attach them with
``responses=`` and ``openapi_extra=`` only, so changing a model changes the
document and nothing else. Keep them in step with the render functions in
``shoal/api/*.py``, ``shoal/runs/manager.py`` and ``shoal/gateway/*.py``
(``tests/api/test_openapi_document.py`` holds real answers to them).

Every shape allows extra fields (the protocol evolves additively, and the
providers' objects carry more than is listed here); the fields listed are
the ones Shoal always sends, required unless marked optional.
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shoal.runs.manager import MAX_FILE_IDS
from shoal.sandbox.result import Limit

from ._bodies import MAX_CONTAINER_NAME_CHARS
from .errors import ErrorBody


class Wire(BaseModel):
    """A JSON object on the wire: the fields listed, and perhaps more."""

    model_config = ConfigDict(extra="allow")


# -- errors, one shape per dialect ----------------------------------------------------------------
class OpenAIErrorDetail(Wire):
    message: str
    type: str = Field(examples=["invalid_request_error", "server_error"])
    param: str | None
    code: str | None = Field(examples=["not_found", "rate_limit_exceeded"])


class OpenAIError(Wire):
    """OpenAI's error object (``/v1/responses``, ``/v1/containers``, the runs API, the
    tenant Files API)."""

    error: OpenAIErrorDetail
    request_id: str | None = Field(None, description="Echoed in x-request-id")


class AnthropicErrorDetail(Wire):
    type: str = Field(examples=["invalid_request_error", "not_found_error", "overloaded_error"])
    message: str


class AnthropicError(Wire):
    """Anthropic's error response (``/v1/messages``, and the Files API asked with
    ``anthropic-version``)."""

    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: str | None = Field(None, description="Echoed in request-id")


# The Files API answers in the dialect of whoever asks: the protocol's {detail}
# with scope_id (Zylon), else OpenAI's or (anthropic-version) Anthropic's.
FilesError = Union[ErrorBody, OpenAIError, AnthropicError]

_STATUS = {400: "Bad request", 401: "Missing or invalid token", 403: "Not allowed",
           404: "Not found", 409: "Not possible in the run's state", 413: "Too large",
           422: "Malformed request", 429: "The tenant's quota is used up",
           501: "No upstream model is configured", 503: "At capacity; retry (Retry-After)",
           507: "Disk quota full"}


def errors(model: Any, *statuses: int) -> dict:
    """``responses=`` entries: these statuses, each with ``model`` as its body."""
    return {status: {"model": model, "description": _STATUS[status]} for status in statuses}


PROTOCOL_ERRORS = errors(ErrorBody, 400, 401, 403, 404, 413, 422, 429, 503, 507)
METRICS_ERRORS = {**errors(ErrorBody, 401),
                  403: {"model": ErrorBody, "description": "Not an operator token"}}
FILES_ERRORS = errors(FilesError, 400, 401, 403, 404, 413, 422, 429, 503, 507)
CONTAINERS_ERRORS = errors(OpenAIError, 400, 401, 403, 404, 413, 422, 429, 503, 507)
RUNS_ERRORS = errors(OpenAIError, 401, 403, 404, 409, 422, 429, 503)
RESPONSES_ERRORS = {**errors(OpenAIError, 400, 401, 404, 422, 429, 501, 503),
                    "default": {"model": OpenAIError,
                                "description": "The upstream's error, with its status"}}
MESSAGES_ERRORS = {**errors(AnthropicError, 400, 401, 404, 429, 501, 503),
                   "default": {"model": AnthropicError,
                               "description": "The upstream's error, with its status"}}


# -- helpers for bodies FastAPI does not parse ----------------------------------------------------
def _inlined(schema: dict) -> dict:
    """A pydantic schema with its ``$defs`` written in place: a request body's schema
    lives inside the operation, where ``#/$defs/...`` would not resolve."""
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith("#/$defs/"):
            target = resolve(copy.deepcopy(definitions[reference[len("#/$defs/"):]]))
            return {**target, **{key: resolve(value) for key, value in node.items()
                                 if key != "$ref"}}
        resolved = {key: resolve(value) for key, value in node.items()}
        if isinstance(resolved.get("discriminator"), dict) and "oneOf" in resolved:
            # Its mapping names $defs; with the schemas inline only the property is left.
            resolved["discriminator"] = {"propertyName": resolved["discriminator"]["propertyName"]}
        return resolved

    return resolve(schema)


def schema_of(shape: Any) -> dict:
    """The self-contained JSON schema of a model or type, as a request reads it."""
    return _inlined(TypeAdapter(shape).json_schema(mode="validation"))


def request_body(*, json: Any = None, multipart: Any = None, binary: bool = False,
                 required: bool = True, description: str | None = None) -> dict:
    """``openapi_extra=`` for a body the route reads itself."""
    content: dict = {}
    if json is not None:
        content["application/json"] = {"schema": schema_of(json)}
    if multipart is not None:
        content["multipart/form-data"] = {"schema": schema_of(multipart)}
    if binary:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    body: dict = {"required": required, "content": content}
    if description:
        body["description"] = description
    return {"requestBody": body}


def event_stream(events: list[str], description: str) -> dict:
    """A ``text/event-stream`` media type: each event as FastAPI documents its own
    (``itemSchema``), its ``data`` one JSON object unless said otherwise."""
    return {"text/event-stream": {"itemSchema": {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string", "enum": events},
            "data": {"type": "string", "description": "The event's payload"},
            "id": {"type": "string", "description": "Increasing; replay after it with "
                                                    "Last-Event-ID"},
            "retry": {"type": "integer", "minimum": 0},
        }}, "x-events": description}}


BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


# -- protocol v1 (/sessions) ----------------------------------------------------------------------
class CreateSessionRequest(Wire):
    """Lifetime hints (clamped to the server's ceilings, never raised) and an image hint."""

    image: str | None = Field(None, description="A hint; a pre-baked pool may ignore it")
    idle_timeout_seconds: int | None = Field(None, ge=1)
    max_lifetime_seconds: int | None = Field(None, ge=1)
    container: str | None = Field(None, description="Attach the session to this durable "
                                                    "container (made if it does not exist)")


class SessionHandle(Wire):
    session_id: str = Field(min_length=1)
    idle_timeout_seconds: int = Field(description="The idle timeout in force")
    max_lifetime_seconds: int = Field(description="The maximum lifetime in force")
    created_at: float = Field(description="POSIX seconds")
    last_activity_at: float = Field(description="POSIX seconds")
    expires_at: float = Field(description="When the session is reclaimed if unused, "
                                          "POSIX seconds")
    container_id: str | None = Field(description="The durable container it is attached to")


class CodeExecutionInput(Wire):
    code: str = Field(min_length=1)
    language: Literal["python", "javascript"] = Field(
        "python", description="Shoal's extension: javascript runs on Bun")


class BashExecutionInput(Wire):
    command: str = Field(min_length=1)


class TextEditorInput(Wire):
    """Checked per command: create needs file_text, str_replace old_str and new_str,
    insert insert_line and new_str (or insert_text)."""

    command: Literal["view", "create", "str_replace", "insert", "undo_edit"]
    path: str = Field(min_length=1)
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: int | None = None
    insert_text: str | None = Field(None, description="Zylon's name for insert's new_str")
    view_range: list[int] | None = Field(None, min_length=2, max_length=2)


class CodeExecutionRequest(Wire):
    tool: Literal["code_execution"]
    input: CodeExecutionInput
    timeout_seconds: int | None = Field(None, ge=1, description="Clamped to the server's ceiling")
    tool_use_id: str | None = Field(None, description="Generated when absent; echoed")


class BashExecutionRequest(Wire):
    tool: Literal["bash_code_execution"]
    input: BashExecutionInput
    timeout_seconds: int | None = Field(None, ge=1, description="Clamped to the server's ceiling")
    tool_use_id: str | None = Field(None, description="Generated when absent; echoed")


class TextEditorRequest(Wire):
    tool: Literal["text_editor_code_execution"]
    input: TextEditorInput
    timeout_seconds: int | None = Field(None, ge=1, description="Clamped to the server's ceiling")
    tool_use_id: str | None = Field(None, description="Generated when absent; echoed")


ExecRequest = Annotated[Union[CodeExecutionRequest, BashExecutionRequest, TextEditorRequest],
                        Field(discriminator="tool")]


class CodeExecutionOutputFile(Wire):
    type: Literal["code_execution_output"]
    file_id: str = Field(description="The base64url of the file's sandbox path")
    filename: str


class CodeExecutionResult(Wire):
    """Always this payload, also for a program that failed (never an error variant)."""

    type: Literal["code_execution_result"]
    stdout: str
    stderr: str
    return_code: int
    content: list[CodeExecutionOutputFile] = Field(description="Files the call produced")


class ResultBlock(Wire):
    type: Literal["code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result"]
    tool_use_id: str
    content: CodeExecutionResult


class ExecResponse(Wire):
    tool_use_id: str
    result_block: ResultBlock
    execution_time_ms: int = Field(ge=0)
    limits: list[Limit] = Field(description="Shoal's extension: the limits that stopped or "
                                            "cut the call")
    interpreter_restarted: bool = Field(description="Shoal's extension: interpreter state "
                                                    "from before this call is gone")


EXEC_EVENTS = event_stream(["output", "result", "error"], (
    "With Accept: text/event-stream: `output` {stream: stdout|stderr, text} as the call "
    "prints, then one `result` carrying exactly the ExecResponse, or `error` {detail}."))


class PlatformTool(Wire):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="A Python identifier")
    doc: str | None = None


class RegisterProgrammaticTools(Wire):
    callback_url: str = Field(description="Only hosts the operator allowed "
                                          "(SHOAL_CALLBACK_ALLOW)")
    token: str = Field(min_length=1, description="Sent as the callback's bearer token")
    timeout_seconds: float = Field(300, ge=1, le=3600)
    tools: list[PlatformTool] = Field(min_length=1)


class ProgrammaticToolsRegistered(Wire):
    stub_path: str = Field(description="The module the code imports the stubs from")
    tool_count: int


class WorkspaceFile(Wire):
    path: str
    size_bytes: int = Field(ge=0)
    mime_type: str | None
    modified_at: float = Field(description="POSIX seconds")


class FileList(Wire):
    files: list[WorkspaceFile]


class WorkspaceUpload(Wire):
    file: bytes
    path: str | None = Field(None, description="Destination; the uploaded file's name if absent")


class FileUploadResult(Wire):
    path: str
    size_bytes: int = Field(ge=0)


# -- the Files API: Zylon's (scope_id) and the tenant's (OpenAI's or Anthropic's shape) -----------
class FileScope(Wire):
    id: str = Field(description="The container id")
    type: Literal["session"]


class ScopedFile(Wire):
    """A file in a container, in Zylon's Files API (``scope_id``)."""

    id: str = Field(description="The base64url of the sandbox path, unpadded")
    type: Literal["file"]
    filename: str
    mime_type: str
    size_bytes: int = Field(ge=0)
    created_at: datetime
    downloadable: bool = Field(description="True for outputs, false for uploads")
    etag: str | None
    namespace: Literal["session"]
    scope: FileScope
    key: str
    path: str


class ScopedFileList(Wire):
    data: list[ScopedFile]
    first_id: str | None
    last_id: str | None
    has_more: bool


class RuntimeLibrary(Wire):
    name: str
    version: str
    promised: bool = Field(description="Named by a gateway document as installed")
    import_: str | None = Field(None, alias="import", description="The module to import")


class RuntimePython(Wire):
    version: str | None
    libraries: list[RuntimeLibrary]


class RuntimeJavaScript(Wire):
    runtime: Literal["bun"]
    version: str
    packages: list[str]
    note: str


class RuntimeTool(Wire):
    command: str
    package: str | None
    purpose: str
    path: str | None
    available: bool = Field(description="False where this host's build left it out")


class RuntimeNetwork(Wire):
    egress: bool = Field(description="Whether the sandbox has a proxy to what the operator "
                                     "allows (HTTP(S)_PROXY)")
    model_api: bool = Field(description="Whether code run by the gateway may call the model "
                                        "(ANTHROPIC_BASE_URL, OPENAI_BASE_URL)")


class RuntimeDescription(Wire):
    """What code in a sandbox can use (``GET /v1/runtime``)."""

    object: Literal["runtime"]
    python: RuntimePython
    javascript: RuntimeJavaScript
    tools: list[RuntimeTool]
    paths: dict[str, str]
    network: RuntimeNetwork


class FileDeleted(Wire):
    id: str
    type: Literal["file_deleted"]


class PrefixDeleted(Wire):
    prefix: str
    deleted_count: int = Field(ge=0)
    type: Literal["prefix_deleted"]


class OpenAIFile(Wire):
    id: str
    object: Literal["file"]
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    expires_at: int | None
    status_details: str | None


class OpenAIFileList(Wire):
    object: Literal["list"]
    data: list[OpenAIFile]
    has_more: bool
    first_id: str | None
    last_id: str | None


class OpenAIFileDeleted(Wire):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


class AnthropicFile(Wire):
    """Anthropic's FileMetadata; a container's file named by its scoped id has ``scope``."""

    id: str
    type: Literal["file"]
    filename: str
    mime_type: str
    size_bytes: int = Field(ge=0)
    created_at: datetime
    downloadable: bool
    scope: FileScope | None = None


class AnthropicFileList(Wire):
    data: list[AnthropicFile]
    has_more: bool
    first_id: str | None
    last_id: str | None
    next_page: str | None = Field(description="The cursor of the next page; null on the last")


class FilesUpload(Wire):
    file: bytes
    path: str | None = Field(None, description="With scope_id: the key (else the file's name)")
    purpose: str | None = Field(None, description="The tenant Files API's purpose")


# -- OpenAI's Containers API ----------------------------------------------------------------------
class ExpiresAfter(Wire):
    anchor: Literal["last_active_at"]
    minutes: int


class NetworkPolicy(Wire):
    type: Literal["disabled", "allowlist"] = Field(
        description="disabled: no egress; allowlist: the domains the container may reach "
                    "(within what the operator allows)")
    allowed_domains: list[str] | None = None


class Container(Wire):
    id: str
    object: Literal["container"]
    created_at: int
    status: Literal["active", "expired", "deleted"]
    expires_after: ExpiresAfter
    last_active_at: int
    expires_at: int
    memory_limit: str | None
    name: str | None
    implicit: bool = Field(description="Made for a run given file_ids and no container")
    network_policy: NetworkPolicy


class ContainerList(Wire):
    object: Literal["list"]
    data: list[Container]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ContainerDeleted(Wire):
    id: str
    object: Literal["container.deleted"]
    deleted: Literal[True]


class RequestedExpiry(Wire):
    anchor: Literal["last_active_at"] = "last_active_at"
    minutes: int | None = Field(None, ge=1, le=240)


class CreateContainer(Wire):
    name: str | None = Field(None, max_length=MAX_CONTAINER_NAME_CHARS)
    expires_after: RequestedExpiry | None = None
    file_ids: list[str] = Field(default_factory=list, description="Tenant Files API uploads "
                                f"to attach: at most {MAX_FILE_IDS} distinct ids (a repeated "
                                "id is attached once)")
    memory_limit: Literal["1g", "4g", "16g", "64g"] | None = None
    network_policy: NetworkPolicy | None = None


class ContainerFileObject(Wire):
    id: str = Field(description="cfile_...")
    object: Literal["container.file"]
    created_at: int
    bytes: int = Field(ge=0)
    container_id: str
    path: str = Field(description="Outputs under /mnt/data/, uploads under "
                                  "/mnt/user-data/uploads/")
    source: Literal["user", "assistant"]


class ContainerFileList(Wire):
    object: Literal["list"]
    data: list[ContainerFileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ContainerFileDeleted(Wire):
    id: str
    object: Literal["container.file.deleted"]
    deleted: Literal[True]


class ContainerUpload(Wire):
    file: bytes


class AttachFile(Wire):
    file_id: str = Field(min_length=1, description="A tenant Files API upload")


# -- the runs API (/v1/code-execution/runs) -------------------------------------------------------
class FunctionTool(Wire):
    """A function tool in OpenAI's Responses or Chat shape (``function``), or
    Anthropic's (``input_schema``)."""

    type: str = "function"
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class StartRun(Wire):
    language: Literal["python", "javascript"] = "python"
    code: str = Field(min_length=1)
    tools: list[FunctionTool] = Field(default_factory=list)
    allowed_tools: list[str] = Field(default_factory=list, description="The tools the code may "
                                                                       "call (default-deny)")
    container: str | None = Field(None, description="A container id (container_id is accepted "
                                                    "too)")
    file_ids: list[str] = Field(default_factory=list, description="Tenant Files API uploads "
                                f"to attach: at most {MAX_FILE_IDS} distinct ids (a repeated "
                                "id is attached once)")
    timeout_ms: int = Field(30_000, ge=1, description="Clamped to 300000")


class GeneratedFile(Wire):
    file_id: str
    filename: str
    mime_type: str
    size_bytes: int = Field(ge=0)
    container_id: str | None
    path: str


class PendingToolCall(Wire):
    call_id: str
    name: str
    arguments: Any


class RunRecord(Wire):
    """A run in Caronte's tool result shape."""

    run_id: str
    stdout: str
    stderr: str
    exit_code: int | None = Field(description="Null unless completed")
    status: Literal["running", "completed", "failed", "cancelled"]
    duration_ms: int = Field(ge=0)
    inner_tool_calls: int = Field(ge=0)
    files: list[GeneratedFile]
    language: str
    created_at: int
    container_id: str | None = Field(None, description="Absent when the run used no container")
    implicit: bool | None = Field(None, description="With container_id: made for this run")
    error: str | None = Field(None, description="Why it failed or was cancelled")
    pending_tool_calls: list[PendingToolCall] | None = Field(
        None, description="While running: the calls waiting for tool-results")


RUN_EVENTS = event_stream(
    ["run.created", "run.output", "tool_call.required", "run.completed", "run.failed", "message"],
    "`run.created` {runId, status, container_id}; `run.output` {runId, stream, text} (Shoal's "
    "extension); `tool_call.required` {runId, calls: [{call_id, name, arguments}]}; "
    "`run.completed` {runId, stdout, stderr, exit_code, duration_ms, inner_tool_calls, files, "
    "container_id}; `run.failed` {runId, stdout, stderr, duration_ms, error, status, "
    "container_id}; then the `[DONE]` sentinel (no event name, data `[DONE]`).")


class ToolResult(Wire):
    call_id: str
    output: Any = None
    error: str | None = None
    is_error: bool = False


class SubmitToolResults(Wire):
    results: list[ToolResult] = Field(min_length=1)


class ToolResultsAccepted(Wire):
    run_id: str
    accepted: int = Field(ge=0, description="How many results were new")


# -- /v1/messages (Anthropic) ---------------------------------------------------------------------
class MessagesContainer(Wire):
    id: str | None = None
    skills: list[Any] | None = None


class MessagesRequest(Wire):
    """Anthropic's Messages request; with a code-execution tool
    (``code_execution_20250825``, ``code_execution_v1``, ``code_execution_20250522``) it
    is served here, else passed to the upstream as it is."""

    model: str
    max_tokens: int | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    container: str | MessagesContainer | None = None
    system: str | list[dict[str, Any]] | None = None
    stream: bool | None = None


class MessageContainer(Wire):
    id: str
    expires_at: datetime


class Message(Wire):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="text, server_tool_use and the "
                                                      "*_tool_result blocks")
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, Any]
    container: MessageContainer | None = None


MESSAGE_EVENTS = event_stream(
    ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
     "message_delta", "message_stop", "ping", "error"],
    "Anthropic's streaming events, each data {type, ...}; result blocks arrive whole in "
    "content_block_start; message_delta carries the container.")


class MessagesValidation(Wire):
    type: Literal["validation"]
    valid: Literal[True]
    code_execution: bool
    upstream_configured: bool
    mode: Literal["strict", "zylon", "legacy"] | None = None
    upstream_tools: list[str] | None = None
    container: str | None = None
    skills: list[str] | None = None
    stream: bool | None = None


# -- /v1/responses (OpenAI) -----------------------------------------------------------------------
class ResponsesRequest(Wire):
    """OpenAI's Responses request; with ``code_interpreter`` or
    ``caronte:code_execution`` it is served here, else passed to the upstream."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    store: bool | None = None
    stream: bool | None = None


class ResponseObject(Wire):
    id: str
    object: Literal["response"]
    created_at: int
    status: str = Field(examples=["completed", "incomplete", "in_progress", "failed"])
    model: str | None
    output: list[dict[str, Any]] = Field(description="code_interpreter_call, message and "
                                                     "function_call items")
    error: dict[str, Any] | None
    usage: dict[str, Any] | None


RESPONSE_EVENTS = event_stream(
    ["response.created", "response.in_progress", "response.output_item.added",
     "response.output_item.done", "response.content_part.added", "response.content_part.done",
     "response.output_text.delta", "response.output_text.done",
     "response.output_text.annotation.added", "response.code_interpreter_call.in_progress",
     "response.code_interpreter_call_code.delta", "response.code_interpreter_call_code.done",
     "response.code_interpreter_call.interpreting", "response.code_interpreter_call.completed",
     "response.function_call_arguments.delta", "response.function_call_arguments.done",
     "response.completed", "response.incomplete", "response.failed", "error"],
    "OpenAI's streaming events, each data {type, sequence_number, ...}.")


class ResponseDeleted(Wire):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


# -- probes ---------------------------------------------------------------------------------------
ReadinessReason = Literal["draining", "at_capacity", "uids_exhausted", "pool_cannot_warm",
                          "disk_low", "degraded"]


class Liveness(Wire):
    status: Literal["ok"]


class Ready(Wire):
    status: Literal["ready"]


class NotReady(Wire):
    status: Literal["not_ready"]
    reasons: list[ReadinessReason] = Field(min_length=1)
    details: list[str] | None = Field(None, description="The operator's only")


class Health(Wire):
    """Always 200. The counts and details are the operator's only."""

    status: Literal["ok", "degraded"]
    reasons: list[ReadinessReason] | None = None
    sessions: int | None = None
    max_sessions: int | None = None
    pool_ready: int | None = None
    pool_target: int | None = None
    uids_free: int | None = None
    launcher: str | None = None
    memory_available_bytes: int | None = Field(
        None, description="The host's available memory (MemAvailable): with "
                          "sandbox_memory_bytes, how many more sandboxes it has room for.")
    sandbox_memory_bytes: int | None = Field(None, description="A new sandbox's memory limit.")
    details: list[str] | None = None


PROMETHEUS = {"text/plain": {"schema": {
    "type": "string", "description": "The Prometheus text exposition format"}}}
