"""A scripted stand-in for the paid model services, for gateway tests.

Shoal's gateway sits in front of Anthropic's Messages API (``POST /v1/messages``) and
OpenAI's Responses API (``POST /v1/responses``). Its tests cannot call the real, paid
services, so they point the gateway at a :class:`ScriptedUpstream`: a real HTTP server
on loopback (a background thread, port picked by the kernel) that answers each request
with the next *turn* the test scripted, in the providers' exact wire formats, JSON or
SSE. The shapes follow what the official SDKs parse (``/work/research/anthropic.md``,
``/work/research/openai.md``); ``test_scripted_upstream.py`` proves it by driving this
server with the ``anthropic`` and ``openai`` packages directly.

What this module owns:

* the turn builders: :func:`anthropic_turn` with :func:`text` and :func:`tool_use`
  blocks; :func:`openai_turn` with :func:`message` and :func:`function_call` items;
* rendering a turn as a JSON body or as an SSE stream, paced by the turn's ``chunk``,
  ``delay``, ``hang_after`` and ``end_after``;
* the server: the turn queue, scripted failures (:meth:`ScriptedUpstream.fail`), and a
  record of every request received (:class:`Recorded`).

Usage::

    with ScriptedUpstream() as upstream:
        upstream.script(
            anthropic_turn(tool_use("python", {"code": "1+1"})),
            lambda body: anthropic_turn(text(f"saw {len(body['messages'])} messages")),
        )
        ...point the gateway at upstream.url, run it...
        assert upstream.requests[0].headers["anthropic-version"]

Each request consumes one turn. A turn is a built description or a callable
``turn(request_body) -> description``, called when the request arrives. When the queue
is empty the server answers 500 "scripted upstream: no turn left" (with
``x-should-retry: false``, so SDK clients do not retry it), so a test that loops too
often fails visibly. Problems of the script itself (no turn left, a turn of the other
dialect, a callable that raised) are also kept in :attr:`Recorded.error`.

Streams use chunked transfer encoding, are flushed event by event, and the connection
is closed after the last event, as the real services do (the Anthropic SDK reads until
the server closes). A client that goes away mid-stream sets
:attr:`Recorded.disconnected`.
"""

from __future__ import annotations

import copy
import json
import secrets
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Union
from urllib.parse import urlsplit

__all__ = [
    "ScriptedUpstream",
    "Recorded",
    "Pacing",
    "AnthropicTurn",
    "OpenAITurn",
    "anthropic_turn",
    "text",
    "tool_use",
    "openai_turn",
    "message",
    "function_call",
    "reasoning",
]

DEFAULT_MODEL = "scripted-model"
DEFAULT_CHUNK = 8
DEFAULT_INPUT_TOKENS = 10
DEFAULT_OUTPUT_TOKENS = 5

Event = tuple[str, dict]  # (SSE event name, JSON payload)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _pieces(s: str, size: int) -> list[str]:
    """``s`` cut into pieces of ``size`` characters (none for an empty string)."""
    return [s[i:i + size] for i in range(0, len(s), size)]


@dataclass(frozen=True)
class Pacing:
    """How a turn is streamed.

    ``chunk``: characters per text delta and per tool-input / arguments delta.
    ``delay``: seconds to wait before each streamed event after the first (a
    non-streaming answer waits once before its body).
    ``hang_after``: send only this many events, then keep the connection open without
    writing until the client goes away or the server closes. A value at or above the
    number of events sends them all but never closes. A non-streaming answer counts as
    one event, so ``hang_after=0`` makes it never answer.
    ``end_after``: send only this many events, then end the body cleanly, as a
    connection closed mid-answer looks to a reader of a close-delimited body.
    """

    chunk: int = DEFAULT_CHUNK
    delay: float = 0.0
    hang_after: int | None = None
    end_after: int | None = None

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError("chunk must be at least 1")
        if self.delay < 0:
            raise ValueError("delay must not be negative")
        if self.hang_after is not None and self.hang_after < 0:
            raise ValueError("hang_after must not be negative")


# --------------------------------------------------------------------------- Anthropic


def text(s: str) -> dict:
    """An Anthropic text content block."""
    return {"type": "text", "text": s}


def tool_use(name: str, input: dict, id: str | None = None) -> dict:
    """An Anthropic tool_use content block; ``id`` defaults to ``toolu_<random>``."""
    return {"type": "tool_use", "id": id or _new_id("toolu_"), "name": name, "input": dict(input)}


@dataclass(frozen=True)
class AnthropicTurn:
    """One scripted Messages API answer. Build it with :func:`anthropic_turn`."""

    content: tuple[dict, ...]
    stop_reason: str
    usage: dict
    model: str
    pacing: Pacing

    def render(self, request: dict) -> dict:
        """The non-streaming Message; a fresh ``msg_`` id each time."""
        return {
            "id": _new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(block) for block in self.content],
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": dict(self.usage),
        }

    def events(self, request: dict) -> Iterator[Event]:
        """The recorded order of the real API: message_start (``content: []``, like the
        real API with ``output_tokens: 1``), a ping, each block's start, deltas and stop,
        then message_delta (stop reason, final ``output_tokens``) and message_stop."""
        final = self.render(request)
        start = {**final, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**final["usage"], "output_tokens": 1}}
        yield "message_start", {"type": "message_start", "message": start}
        yield "ping", {"type": "ping"}
        for index, block in enumerate(final["content"]):
            yield from _anthropic_block_events(index, block, self.pacing.chunk)
        yield "message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": final["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": final["usage"]["output_tokens"]},
        }
        yield "message_stop", {"type": "message_stop"}


def _anthropic_block_events(index: int, block: dict, chunk: int) -> Iterator[Event]:
    """Text streams as text_delta pieces from ``text: ""``; a tool call streams its input
    as input_json_delta pieces (the first one empty, as the real API does) from
    ``input: {}``; any other block arrives whole in content_block_start."""
    if block["type"] == "text":
        start = {**block, "text": ""}
        deltas = [{"type": "text_delta", "text": piece} for piece in _pieces(block["text"], chunk)]
    elif block["type"] in ("tool_use", "server_tool_use"):
        start = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": piece}
                  for piece in ["", *_pieces(_dumps(block["input"]), chunk)]]
    else:
        start, deltas = block, []
    yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
    for delta in deltas:
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def anthropic_turn(*blocks: dict, stop_reason: str | None = None, usage: dict | None = None,
                   model: str = DEFAULT_MODEL, chunk: int = DEFAULT_CHUNK, delay: float = 0.0,
                   hang_after: int | None = None, end_after: int | None = None) -> AnthropicTurn:
    """An Anthropic turn answering with ``blocks`` (:func:`text`, :func:`tool_use`, or any
    block dict). ``stop_reason`` defaults to ``"tool_use"`` when a tool_use block is
    present, else ``"end_turn"``. ``usage`` is merged over
    ``{"input_tokens": 10, "output_tokens": 5}``."""
    if stop_reason is None:
        stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    return AnthropicTurn(
        content=tuple(blocks),
        stop_reason=stop_reason,
        usage={"input_tokens": DEFAULT_INPUT_TOKENS, "output_tokens": DEFAULT_OUTPUT_TOKENS, **(usage or {})},
        model=model,
        pacing=Pacing(chunk, delay, hang_after, end_after),
    )


# --------------------------------------------------------------------------- OpenAI


def message(s: str) -> dict:
    """An OpenAI Responses assistant message output item with one output_text part."""
    return {
        "id": _new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": s, "annotations": [], "logprobs": []}],
    }


def function_call(name: str, arguments: dict | str, call_id: str | None = None) -> dict:
    """An OpenAI function_call output item. A dict ``arguments`` is sent JSON-encoded (the
    wire carries a string); ``call_id`` defaults to ``call_<random>``."""
    return {
        "id": _new_id("fc_"),
        "type": "function_call",
        "call_id": call_id or _new_id("call_"),
        "name": name,
        "arguments": arguments if isinstance(arguments, str) else _dumps(arguments),
        "status": "completed",
    }


def reasoning(summary: str = "") -> dict:
    """An OpenAI reasoning output item (a reasoning model's). Its ``encrypted_content``
    is filled in only when the request's ``include`` asks for
    ``reasoning.encrypted_content``, as the real API does."""
    return {"id": _new_id("rs_"), "type": "reasoning",
            "summary": [{"type": "summary_text", "text": summary}] if summary else []}


def _rendered_item(item: dict, request: dict) -> dict:
    if item.get("type") != "reasoning":
        return dict(item)
    include = request.get("include") if isinstance(request.get("include"), list) else []
    sealed = "reasoning.encrypted_content" in include
    return {**item, "encrypted_content": "gAAAA" + item["id"] if sealed else None}


def _unpersisted_item(body: dict) -> str | None:
    """The id of an input item the real API cannot resolve: with ``"store": false``
    nothing is kept, so a reasoning item sent back without its encrypted content
    names an item that does not exist (OpenAI answers 404)."""
    if body.get("store") is not False or not isinstance(body.get("input"), list):
        return None
    for item in body["input"]:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "item_reference" or (
                item.get("type") == "reasoning" and item.get("id") and not item.get("encrypted_content")):
            return str(item.get("id"))
    return None


_TERMINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


@dataclass(frozen=True)
class OpenAITurn:
    """One scripted Responses API answer. Build it with :func:`openai_turn`."""

    output: tuple[dict, ...]
    status: str
    usage: dict
    model: str
    pacing: Pacing

    def render(self, request: dict) -> dict:
        """The non-streaming Response. Request parameters a real Response reflects
        (tools, tool_choice, instructions, ...) are echoed from ``request``."""
        now = int(time.time())
        return {
            "id": _new_id("resp_"),
            "object": "response",
            "created_at": now,
            "status": self.status,
            "completed_at": now if self.status == "completed" else None,
            "background": False,
            "error": {"code": "server_error", "message": "scripted failure"} if self.status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "metadata": request.get("metadata") or {},
            "model": self.model,
            "output": [_rendered_item(item, request) for item in self.output],
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
            "store": request.get("store", True),
            "temperature": request.get("temperature", 1.0),
            "text": request.get("text") or {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "top_p": request.get("top_p", 1.0),
            "truncation": request.get("truncation", "disabled"),
            "usage": dict(self.usage),
            "user": request.get("user"),
        }

    def events(self, request: dict) -> Iterator[Event]:
        """The order of openai.md §4.3: response.created (``output: []``) and
        response.in_progress, each item's events, then the terminal event carrying the
        full response. Every event has an increasing ``sequence_number`` from 0."""
        final = self.render(request)
        pending = {**final, "status": "in_progress", "completed_at": None, "error": None,
                   "incomplete_details": None, "output": [], "usage": None}
        events: list[Event] = [("response.created", {"response": pending}),
                               ("response.in_progress", {"response": pending})]
        for output_index, item in enumerate(final["output"]):
            events += _openai_item_events(output_index, item, self.pacing.chunk)
        events.append((_TERMINAL_EVENT[final["status"]], {"response": final}))
        for sequence_number, (kind, payload) in enumerate(events):
            yield kind, {"type": kind, **payload, "sequence_number": sequence_number}


def _openai_item_events(output_index: int, item: dict, chunk: int) -> list[Event]:
    """output_item.added, the item's content events, output_item.done. A message's
    output_text parts stream as output_text.delta pieces between content_part.added
    and .done; a function call streams its arguments; other items arrive whole."""
    at = {"item_id": item.get("id"), "output_index": output_index}
    added = {**item, "status": "in_progress"} if "status" in item else dict(item)
    body: list[Event] = []
    if item["type"] == "message":
        added["content"] = []
        for content_index, part in enumerate(item["content"]):
            body += _openai_part_events({**at, "content_index": content_index}, part, chunk)
    elif item["type"] == "function_call":
        added["arguments"] = ""
        body += [("response.function_call_arguments.delta", {**at, "delta": piece})
                 for piece in _pieces(item["arguments"], chunk)]
        body.append(("response.function_call_arguments.done", {**at, "arguments": item["arguments"]}))
    return [("response.output_item.added", {"output_index": output_index, "item": added}),
            *body,
            ("response.output_item.done", {"output_index": output_index, "item": item})]


def _openai_part_events(at: dict, part: dict, chunk: int) -> list[Event]:
    if part["type"] != "output_text":
        return [("response.content_part.added", {**at, "part": part}),
                ("response.content_part.done", {**at, "part": part})]
    logprobs = part.get("logprobs", [])
    return [("response.content_part.added", {**at, "part": {**part, "text": "", "annotations": [], "logprobs": []}}),
            *[("response.output_text.delta", {**at, "delta": piece, "logprobs": []})
              for piece in _pieces(part["text"], chunk)],
            ("response.output_text.done", {**at, "text": part["text"], "logprobs": logprobs}),
            ("response.content_part.done", {**at, "part": part})]


def openai_turn(*items: dict, status: str = "completed", usage: dict | None = None,
                model: str = DEFAULT_MODEL, chunk: int = DEFAULT_CHUNK, delay: float = 0.0,
                hang_after: int | None = None, end_after: int | None = None) -> OpenAITurn:
    """An OpenAI turn answering with ``items`` (:func:`message`, :func:`function_call`, or
    any output item dict). ``status`` is ``completed``, ``incomplete`` or ``failed``; a
    stream ends with the matching ``response.<status>`` event. ``usage`` gives
    ``input_tokens``/``output_tokens`` (default 10/5); the rest of the usage object is
    filled in, since strict SDK validation needs all of it."""
    if status not in _TERMINAL_EVENT:
        raise ValueError(f"status must be one of {sorted(_TERMINAL_EVENT)}, not {status!r}")
    tokens = {"input_tokens": DEFAULT_INPUT_TOKENS, "output_tokens": DEFAULT_OUTPUT_TOKENS, **(usage or {})}
    full_usage = {
        "input_tokens": tokens["input_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": tokens["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens["input_tokens"] + tokens["output_tokens"],
        **{k: v for k, v in tokens.items() if k not in ("input_tokens", "output_tokens")},
    }
    return OpenAITurn(tuple(items), status, full_usage, model,
                      Pacing(chunk, delay, hang_after, end_after))


# --------------------------------------------------------------------------- dialects

Turn = Union[AnthropicTurn, OpenAITurn]
TurnSource = Union[Turn, Callable[[dict], Turn]]

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error", 409: "conflict_error",
    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
    504: "timeout_error", 529: "overloaded_error",
}
_OPENAI_ERRORS = {  # status -> (type, code)
    401: ("invalid_request_error", "invalid_api_key"),
    429: ("requests", "rate_limit_exceeded"),
}


def _anthropic_error(status: int, msg: str) -> dict:
    kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": msg}}


def _openai_error(status: int, msg: str) -> dict:
    kind, code = _OPENAI_ERRORS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return {"error": {"message": msg, "type": kind, "param": None, "code": code}}


@dataclass(frozen=True)
class _Dialect:
    name: str
    turn_type: type
    request_id_header: str
    error_body: Callable[[int, str], dict]


_DIALECTS = {
    "/v1/messages": _Dialect("Anthropic", AnthropicTurn, "request-id", _anthropic_error),
    "/v1/responses": _Dialect("OpenAI", OpenAITurn, "x-request-id", _openai_error),
}


# --------------------------------------------------------------------------- server


@dataclass
class Recorded:
    """One request as received. ``headers`` has lowercased names (repeated headers are
    joined with ", "); ``body`` is the parsed JSON, or None when the body was not JSON
    (``raw`` has the bytes). ``error`` says what was wrong with the script when the
    server answered a 500 of its own. ``disconnected`` is set when the client went away
    before the answer was complete; the server notices while it waits (a ``delay``, a
    hang) or when a write fails, so script a pace to test disconnects."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    raw: bytes
    error: str | None = None
    disconnected: threading.Event = field(default_factory=threading.Event, repr=False)


@dataclass(frozen=True)
class _Failure:
    status: int
    body: Any
    headers: dict[str, str]
    message: str | None


class _ScriptError(Exception):
    """The script cannot answer this request; the message is sent as a 500."""


class ScriptedUpstream:
    """One server speaking both dialects: POST /v1/messages (Anthropic) and POST /v1/responses (OpenAI)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests: list[Recorded] = []
        # Ids of the Responses this server answered with "store" not false: the only
        # ones a later request's previous_response_id may name, as at OpenAI.
        self.stored_responses: set[str] = set()
        self._turns: deque[TurnSource] = deque()
        self._failures: deque[list] = deque()  # [_Failure, times left]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closing = False
        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self._server.upstream = self  # type: ignore[attr-defined]
        bound_host, bound_port = self._server.server_address[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"scripted-upstream:{bound_port}", daemon=True)
        self._thread.start()

    # --- scripting

    def script(self, *turns: TurnSource) -> None:
        """Append turns to the queue; each request to a dialect path consumes one."""
        for turn in turns:
            if not (isinstance(turn, (AnthropicTurn, OpenAITurn)) or callable(turn)):
                raise TypeError(f"a turn is an anthropic_turn(), an openai_turn() or a callable, not {turn!r}")
        with self._lock:
            self._turns.extend(turns)

    def fail(self, status: int, body: Any = None, headers: dict | None = None, times: int = 1, *,
             message: str | None = None) -> None:
        """Answer the next ``times`` requests to a dialect path with this error instead of a
        turn (no turn is consumed; failures queued earlier are used up first). ``body``: a dict is sent as JSON, str/bytes verbatim; None sends the
        error shape of the request's dialect, with ``message``. ``headers`` (e.g.
        ``retry-after-ms``, ``request-id``, ``x-should-retry``) are added to the answer."""
        if times < 1:
            raise ValueError("times must be at least 1")
        failure = _Failure(status, body, {k.lower(): str(v) for k, v in (headers or {}).items()}, message)
        with self._lock:
            self._failures.append([failure, times])

    def reset(self) -> None:
        """Clear the queued turns, the pending failures and the recorded requests."""
        with self._lock:
            self._turns.clear()
            self._failures.clear()
            self.requests.clear()

    @property
    def turns_left(self) -> int:
        with self._lock:
            return len(self._turns)

    # --- lifecycle

    def close(self) -> None:
        """Stop serving and drop every open connection (hanging streams included)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> ScriptedUpstream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- used by the handler threads

    def _record(self, recorded: Recorded) -> None:
        with self._lock:
            self.requests.append(recorded)

    def _next_failure(self) -> _Failure | None:
        with self._lock:
            if not self._failures:
                return None
            entry = self._failures[0]
            entry[1] -= 1
            if entry[1] == 0:
                self._failures.popleft()
            return entry[0]

    def _next_turn(self, dialect: _Dialect, body: dict) -> Turn:
        with self._lock:
            if not self._turns:
                raise _ScriptError("scripted upstream: no turn left")
            source = self._turns.popleft()
        if isinstance(source, (AnthropicTurn, OpenAITurn)):
            turn = source
        else:
            try:
                turn = source(copy.deepcopy(body))  # the record stays as received
            except Exception as exc:
                raise _ScriptError(f"scripted upstream: the turn callable raised {exc!r}") from exc
        if not isinstance(turn, dialect.turn_type):
            raise _ScriptError(f"scripted upstream: the next turn is {turn!r}, "
                               f"not an answer to an {dialect.name} request")
        return turn

    def _track(self, conn: socket.socket, open_: bool) -> bool:
        with self._lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)
            return not self._closing


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ScriptedUpstream/1"
    upstream: ScriptedUpstream

    def setup(self) -> None:
        super().setup()
        self.upstream = self.server.upstream  # type: ignore[attr-defined]
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.upstream._track(self.connection, True):
            self.close_connection = True

    def finish(self) -> None:
        self.upstream._track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def do_POST(self) -> None:
        self._answer()

    do_GET = do_PUT = do_PATCH = do_DELETE = do_POST

    # --- one request

    def _answer(self) -> None:
        target = urlsplit(self.path)
        raw = self._read_body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            name = name.lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        recorded = Recorded(self.command, target.path, target.query, headers, body, raw)
        self.upstream._record(recorded)

        dialect = _DIALECTS.get(target.path)
        if dialect is None or self.command != "POST":
            status = 404 if dialect is None else 405
            recorded.error = f"scripted upstream: no route for {self.command} {target.path}"
            return self._send_json(status, {"error": {"type": "not_found_error", "message": recorded.error}}, {})
        failure = self.upstream._next_failure()
        if failure is not None:
            return self._send_failure(dialect, failure)
        if not isinstance(body, dict):
            return self._send_json(400, dialect.error_body(400, "scripted upstream: the body is not a JSON object"),
                                   {dialect.request_id_header: _new_id("req_")})
        previous = body.get("previous_response_id") if dialect.turn_type is OpenAITurn else None
        if previous is not None and previous not in self.upstream.stored_responses:
            return self._send_json(404, dialect.error_body(
                404, f"Previous response with id '{previous}' not found."),
                {dialect.request_id_header: _new_id("req_")})
        missing = _unpersisted_item(body) if dialect.turn_type is OpenAITurn else None
        if missing is not None:
            return self._send_json(404, dialect.error_body(404, (
                f"Item with id '{missing}' not found. Items are not persisted when `store` is set "
                "to false. Try again with `store` set to true, or remove this item from your "
                "input.")), {dialect.request_id_header: _new_id("req_")})
        try:
            turn = self.upstream._next_turn(dialect, body)
        except _ScriptError as exc:
            recorded.error = str(exc)
            return self._send_json(500, dialect.error_body(500, str(exc)),
                                   {dialect.request_id_header: _new_id("req_"), "x-should-retry": "false"})
        if body.get("stream") is True:
            self._send_stream(dialect, turn, body, recorded)
        else:
            self._send_body(dialect, turn, body, recorded)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    # --- answers

    def _send_failure(self, dialect: _Dialect, failure: _Failure) -> None:
        headers = {dialect.request_id_header: _new_id("req_"), **failure.headers}
        if isinstance(failure.body, (str, bytes)):
            data = failure.body.encode() if isinstance(failure.body, str) else failure.body
            headers.setdefault("content-type", "text/plain; charset=utf-8")
            return self._send_bytes(failure.status, data, headers)
        body = failure.body
        if body is None:
            body = dialect.error_body(failure.status, failure.message or f"scripted failure ({failure.status})")
        self._send_json(failure.status, body, headers)

    def _send_json(self, status: int, body: Any, headers: dict[str, str]) -> None:
        self._send_bytes(status, _dumps(body).encode(), {"content-type": "application/json", **headers})

    def _send_bytes(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_body(self, dialect: _Dialect, turn: Turn, body: dict, recorded: Recorded) -> None:
        if turn.pacing.hang_after == 0:
            return self._hang(recorded)
        if not self._pause(turn.pacing.delay, recorded):
            return
        rendered = turn.render(body)
        self._keep(body, rendered)
        self._send_json(200, rendered, {dialect.request_id_header: _new_id("req_")})

    def _keep(self, body: dict, response: dict) -> None:
        if isinstance(response.get("id"), str) and response.get("object") == "response" and (
                body.get("store") is not False):
            with self.upstream._lock:
                self.upstream.stored_responses.add(response["id"])

    def _send_stream(self, dialect: _Dialect, turn: Turn, body: dict, recorded: Recorded) -> None:
        self.close_connection = True
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("connection", "close")
        self.send_header(dialect.request_id_header, _new_id("req_"))
        self.end_headers()
        pacing = turn.pacing
        for sent, (name, payload) in enumerate(turn.events(body)):
            if sent == 0 and isinstance(payload.get("response"), dict):
                self._keep(body, payload["response"])
            if sent == pacing.hang_after:
                return self._hang(recorded)
            if sent == pacing.end_after:
                break
            if sent and not self._pause(pacing.delay, recorded):
                return
            if not self._write_chunk(f"event: {name}\ndata: {_dumps(payload)}\n\n".encode(), recorded):
                return
        if pacing.hang_after is not None:
            return self._hang(recorded)
        self._write_chunk(b"", recorded)

    def _write_chunk(self, data: bytes, recorded: Recorded) -> bool:
        """One HTTP chunk in one write (``b""`` ends the body); False if the client is gone."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            return True
        except OSError:
            self._client_gone(recorded)
            return False

    def _pause(self, seconds: float, recorded: Recorded) -> bool:
        """Wait ``seconds`` (forever for None) unless the client hangs up or the server
        closes first; True if the client is still there."""
        if seconds is not None and seconds <= 0:
            return True
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return True
            try:
                readable, _, _ = select.select([self.connection], [], [], timeout)
                if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    break
            except (OSError, ValueError):
                break
            if readable:  # the client sent something mid-answer: ignore it, keep the pace
                time.sleep(min(0.05, timeout) if timeout is not None else 0.05)
        self._client_gone(recorded)
        return False

    def _hang(self, recorded: Recorded) -> None:
        self.close_connection = True
        self._pause(None, recorded)

    def _client_gone(self, recorded: Recorded) -> None:
        self.close_connection = True
        if not self.upstream._closing:
            recorded.disconnected.set()
