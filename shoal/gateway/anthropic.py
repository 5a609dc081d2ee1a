"""Anthropic's hosted code-execution tool, served in front of any Messages API model.

The client asks for ``code_execution_20250825`` (strict Anthropic shapes),
Zylon's ``code_execution_v1`` (Anthropic's shapes plus ``detail`` in error
blocks) or the legacy ``code_execution_20250522`` (one Python sub-tool). The
upstream model sees ordinary function tools instead (``bash_code_execution``
and ``text_editor_code_execution``, or ``code_execution``), and the client sees
what Anthropic's own API would send: ``server_tool_use`` blocks, whole result
blocks, the model's text, ``container`` and ``usage.server_tool_use``.

This module owns the mapping both ways: the request and its history to what the
upstream understands (server tool calls and their results become ``tool_use``
and ``tool_result``; ``container_upload`` blocks become files in the container),
and the upstream's stream to the client's (indexes renumbered across the
loop's turns, our tool calls renamed, results rendered in Anthropic's types).
"""

from __future__ import annotations

import json
import math
import posixpath
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import AsyncIterator

from shoal.runs import Run, RunRequest
from shoal.runs.manager import MAX_TIMEOUT_MS
from shoal.sandbox.mounts import OPENAI_DATA, OUTPUTS, SKILLS, UPLOADS, WORKSPACE
from shoal.sessions import scoped_file_id
from shoal.storage import ContainerRecord

from .engine import Turn, ToolUse, for_model
from .upstream import Timing, Upstream, UpstreamError

STRICT, ZYLON, LEGACY = "strict", "zylon", "legacy"
CODE_TOOL_TYPES = {
    "code_execution_20250825": STRICT, "code_execution_20260120": STRICT,
    "code_execution_20260521": STRICT, "code_execution_v1": ZYLON,
    "code_execution_20250522": LEGACY,
}
BASH, EDITOR, PYTHON = "bash_code_execution", "text_editor_code_execution", "code_execution"
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
_MODIFYING = ("create", "str_replace", "insert", "undo_edit")
# Stop reasons of a model cut off mid-answer: a call it was writing is not whole.
_CUT_OFF = ("max_tokens", "model_context_window_exceeded")
RESULT_TYPES = {"bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                "code_execution_tool_result"}
DEFAULT_BASH_TIMEOUT = 60

_LAYOUT = ("Files: the working directory is /home/agent/workspace; files the user uploaded are in "
           "/mnt/user-data/uploads/ (read-only); save deliverables to /mnt/user-data/outputs/ "
           "(they can be downloaded); skills, if any, are in /mnt/skills/ (read-only). There is "
           "no internet access. Python 3 has pandas, numpy, scipy, scikit-learn, statsmodels, "
           "matplotlib, seaborn, openpyxl, python-docx, python-pptx, pypdf, reportlab and more.")
UPSTREAM_TOOLS = {
    BASH: {"name": BASH, "description": (
        "Run a bash command in a sandboxed Linux container. Each call runs in a new shell: "
        "files persist between calls, environment variables and `cd` do not. " + _LAYOUT),
        "input_schema": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The shell command to run."},
            "timeout": {"type": "integer", "description": "Timeout in seconds (default 60)."},
            "restart": {"type": "boolean", "description": "Restart the container's processes "
                                                          "(files are kept)."}},
            "required": ["command"]}},
    EDITOR: {"name": EDITOR, "description": (
        "View, create and edit files in the container: view a file or list a directory "
        "(view_range [start, end], 1-based, -1 = end of file), create or overwrite a file "
        "(file_text), replace one exact unique string (old_str, new_str), insert text after a "
        "line (insert_line, 0 = start of file; insert_text), or undo the last edit. Relative "
        "paths start at /home/agent/workspace. " + _LAYOUT),
        "input_schema": {"type": "object", "properties": {
            "command": {"type": "string", "enum": list(EDITOR_COMMANDS)},
            "path": {"type": "string"},
            "file_text": {"type": "string"}, "old_str": {"type": "string"},
            "new_str": {"type": "string"}, "insert_line": {"type": "integer"},
            "insert_text": {"type": "string"},
            "view_range": {"type": "array", "items": {"type": "integer"}}},
            "required": ["command", "path"]}},
    PYTHON: {"name": PYTHON, "description": (
        "Run Python code in a persistent interpreter in a sandboxed container: variables and "
        "imports persist between calls. Print what you want to see. " + _LAYOUT),
        "input_schema": {"type": "object", "properties": {"code": {"type": "string"}},
                         "required": ["code"]}},
}
_MOUNTS = (WORKSPACE, "/mnt/user-data", SKILLS, "/tmp", OPENAI_DATA)
_READ_ONLY = (UPLOADS, SKILLS)


class InvalidMessagesRequest(ValueError):
    """The request cannot be served as asked; the message says why (a 400)."""


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class MessagesRequest:
    """A /v1/messages request that asks for code execution, parsed."""

    body: dict
    mode: str
    stream: bool
    container_id: str | None
    skills: list[str] | None
    uploads: list[str]
    # Our sub-tools by name, as the upstream sees them.
    code_tools: dict[str, dict] = field(default_factory=dict)


def parse_request(body: dict) -> MessagesRequest | None:
    """The parsed request, or None when it has no code-execution tool (pass it through)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    ours = [tool for tool in tools if isinstance(tool, dict) and isinstance(tool.get("type"), str)
            and tool["type"] in CODE_TOOL_TYPES]
    if not ours:
        return None  # not ours to judge: the upstream answers it as it would
    _check_shapes(tools, body.get("messages"))
    if len(ours) > 1:
        raise InvalidMessagesRequest("give at most one code execution tool")
    mode = CODE_TOOL_TYPES[ours[0]["type"]]
    names = (PYTHON,) if mode == LEGACY else (BASH, EDITOR)
    code_tools = {name: UPSTREAM_TOOLS[name] for name in names}
    for tool in tools:
        if isinstance(tool, dict) and tool not in ours and tool.get("name") in code_tools:
            raise InvalidMessagesRequest(f"a tool named {tool.get('name')!r} clashes with the code "
                                         "execution tool's sub-tools")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidMessagesRequest("messages must be a non-empty list")
    container = body.get("container")
    skills = None
    if isinstance(container, dict):
        skills_given = container.get("skills")
        if skills_given is not None:
            if not isinstance(skills_given, list):
                raise InvalidMessagesRequest("container.skills must be a list")
            skills = []
            for skill in skills_given:
                name = skill.get("skill_id") if isinstance(skill, dict) else skill
                if not isinstance(name, str) or not name:
                    raise InvalidMessagesRequest("each skill needs a skill_id")
                skills.append(name)
        container = container.get("id")
    if container is not None and (not isinstance(container, str) or not container):
        raise InvalidMessagesRequest("container must be a container id, or {id, skills}")
    uploads = [block["file_id"] for message in messages if isinstance(message, dict)
               for block in _blocks(message.get("content"))
               if block.get("type") == "container_upload" and isinstance(block.get("file_id"), str)]
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise InvalidMessagesRequest("stream must be true or false")  # "true" read as false
    stream = body.get("stream") is True
    return MessagesRequest(body=body, mode=mode, stream=stream, container_id=container,
                           skills=skills, uploads=uploads, code_tools=code_tools)


# Block fields the loop looks values up by: a client's list or object there must
# be its 400, not the server's TypeError.
_STRING_FIELDS = ("type", "id", "name", "tool_use_id", "file_id")


def _check_shapes(tools: list, messages: object) -> None:
    """What the loop reads of the request has the types it reads them as."""
    for tool in tools:
        if not isinstance(tool, dict):
            raise InvalidMessagesRequest("each tool must be an object")
        for key in ("type", "name"):
            if tool.get(key) is not None and not isinstance(tool[key], str):
                raise InvalidMessagesRequest(f"a tool's {key} must be a string")
    if not isinstance(messages, list) or not messages:
        raise InvalidMessagesRequest("messages must be a non-empty list")
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidMessagesRequest(f"{where}: each message needs a role, user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidMessagesRequest(f"{where}.content must be a string or a list of blocks")
        for number, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise InvalidMessagesRequest(f"{where}.content.{number}: each block must be an "
                                             "object with a string type")
            for key in _STRING_FIELDS:
                if block.get(key) is not None and not isinstance(block[key], str):
                    raise InvalidMessagesRequest(f"{where}.content.{number}.{key} must be a string")


def _blocks(content: object) -> list[dict]:
    if isinstance(content, list):
        return [block for block in content if isinstance(block, dict)]
    return []


# -- the history, for the upstream -------------------------------------------------------------
_KEPT_KEYS = {"text": ("type", "text", "citations", "cache_control"),
              "tool_use": ("type", "id", "name", "input", "cache_control"),
              "thinking": ("type", "thinking", "signature"),
              "redacted_thinking": ("type", "data")}


def _clean(block: dict) -> dict:
    """A block as the upstream expects it: our extras and nulls dropped."""
    keys = _KEPT_KEYS.get(block.get("type"))
    if keys is None:
        return {key: value for key, value in block.items() if value is not None}
    return {key: block[key] for key in keys if block.get(key) is not None}


def upstream_history(messages: list, upload_notes: dict[str, str]) -> list[dict]:
    """The client's messages as the upstream understands them: server tool calls
    and their result blocks become tool_use in an assistant turn and tool_result
    in the user turn after it; uploads become a note of where the file is."""
    mapped: list[dict] = []
    called: list[str] = []

    def add(role: str, content: list) -> None:
        if not content:
            return
        if mapped and mapped[-1]["role"] == role:
            mapped[-1]["content"].extend(content)
        else:
            mapped.append({"role": role, "content": list(content)})

    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidMessagesRequest("each message needs a role, user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            add(message["role"], [{"type": "text", "text": content}])
            continue
        if not isinstance(content, list):
            raise InvalidMessagesRequest("a message's content must be a string or a list of blocks")
        if message["role"] == "user":
            blocks = []
            for block in _blocks(content):
                if block.get("type") == "container_upload":
                    blocks.append({"type": "text", "text": upload_notes.get(block.get("file_id"), "")})
                else:
                    blocks.append(block)
            add("user", blocks)
            continue
        said: list[dict] = []
        results: list[dict] = []
        for block in _blocks(content):
            kind = block.get("type")
            if kind in RESULT_TYPES:
                results.append(_result_for_upstream(block))
                continue
            if results:  # results end a turn of the model: what follows is a new one
                add("assistant", said)
                add("user", results)
                said, results = [], []
            if kind == "server_tool_use" and block.get("name") in UPSTREAM_TOOLS:
                said.append({"type": "tool_use", "id": block.get("id"), "name": block["name"],
                             "input": block.get("input") or {}})
                called.append(str(block.get("id")))
            else:
                said.append(_clean(block))
        add("assistant", said)
        add("user", results)
    # A call whose result the client did not send back would leave the model hanging.
    answered = {block.get("tool_use_id") for message in mapped if message["role"] == "user"
                for block in message["content"] if block.get("type") == "tool_result"}
    missing = [ident for ident in called if ident not in answered]
    if missing:
        for index, message in enumerate(mapped):
            ids = {b.get("id") for b in message["content"] if b.get("type") == "tool_use"}
            lost = [ident for ident in missing if ident in ids]
            if not lost:
                continue
            filler = [{"type": "tool_result", "tool_use_id": ident, "is_error": True,
                       "content": "the result of this call is not available"} for ident in lost]
            following = mapped[index + 1] if index + 1 < len(mapped) else None
            if following is not None and following["role"] == "user":
                following["content"][:0] = filler
            else:
                mapped.insert(index + 1, {"role": "user", "content": filler})
    return mapped


def _result_for_upstream(block: dict) -> dict:
    content = block.get("content") if isinstance(block.get("content"), dict) else {}
    kind = str(content.get("type", ""))
    if kind.endswith("_error"):
        detail = content.get("detail") if isinstance(content.get("detail"), dict) else {}
        explanation = content.get("error_message") or detail.get("explanation")
        text = f"error: {content.get('error_code', 'unavailable')}"
        if explanation:
            text += f": {explanation}"
        return {"type": "tool_result", "tool_use_id": block.get("tool_use_id"), "content": text,
                "is_error": True}
    if kind in ("bash_code_execution_result", "code_execution_result"):
        text = json.dumps({"stdout": for_model(str(content.get("stdout") or "")),
                           "stderr": for_model(str(content.get("stderr") or "")),
                           "return_code": content.get("return_code")}, ensure_ascii=False)
    else:
        text = json.dumps({key: value for key, value in content.items() if key != "type"},
                          ensure_ascii=False)
    return {"type": "tool_result", "tool_use_id": block.get("tool_use_id"), "content": text}


# -- the loop's adapter ---------------------------------------------------------------------------
class AnthropicAdapter:
    """One /v1/messages request with code execution: its upstream history and the
    client's message, built as the loop goes (streamed or assembled)."""

    def __init__(self, request: MessagesRequest, upstream: Upstream, container: ContainerRecord,
                 history: list[dict], incoming_headers: dict[str, str],
                 container_expiry: "callable") -> None:
        self.request = request
        self.upstream = upstream
        self.timing = Timing()
        self.container = container
        self.history = history
        self.incoming = incoming_headers
        self._expiry = container_expiry
        body = {key: value for key, value in request.body.items()
                if key not in ("messages", "tools", "container", "stream")}
        tools = [tool for tool in request.body["tools"] if tool.get("type") not in CODE_TOOL_TYPES]
        self.upstream_tools = tools + list(request.code_tools.values())
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("name") == "code_execution" and (
                request.mode != LEGACY):
            body["tool_choice"] = {"type": "any"}
        self.base_body = body
        self.message_id = "msg_" + secrets.token_hex(12)
        self.model = request.body.get("model")
        self.content: list[dict] = []
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.executions = 0
        self.stop_reason: str | None = None
        self._started = False
        self._asked = False  # the upstream was called once already
        self._results: list[dict] = []

    # -- the engine's interface ------------------------------------------------------------------
    def is_code_tool(self, name: str) -> bool:
        return name in self.request.code_tools

    def keepalive(self):
        return _sse("ping", {"type": "ping"}) if self.request.stream else None

    def paused(self, pause) -> list:
        return []

    async def upstream_turn(self) -> AsyncIterator[object]:
        if self._results:
            self.history.append({"role": "user", "content": self._results})
            self._results = []
        body = {**self.base_body, "messages": self.history, "tools": self.upstream_tools}
        if self._asked and "tool_choice" in body:
            body["tool_choice"] = _relaxed(body["tool_choice"])
        self._asked = True
        turn = Turn()
        blocks: dict[int, dict] = {}
        turn_output = 0
        async for _, data in self.upstream.events("/v1/messages", body, self.incoming, self.timing):
            kind = data.get("type")
            if kind == "message_start":
                message = data.get("message") or {}
                self._add_usage(message.get("usage") or {}, include_output=False)
                self.model = message.get("model") or self.model
                if not self._started:
                    self._started = True
                    yield self._event("message_start", {"type": "message_start", "message": {
                        "id": self.message_id, "type": "message", "role": "assistant",
                        "model": self.model, "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": dict(self.usage)}})
            elif kind == "content_block_start":
                upstream_block = dict(data.get("content_block") or {})
                entry = self._start_block(upstream_block)
                blocks[data.get("index", len(blocks))] = entry
                yield self._event("content_block_start", {
                    "type": "content_block_start", "index": entry["index"],
                    "content_block": entry["shown_start"]})
            elif kind == "content_block_delta":
                entry = blocks.get(data.get("index"))
                if entry is None:
                    continue
                delta = data.get("delta") or {}
                _accumulate(entry, delta)
                yield self._event("content_block_delta", {"type": "content_block_delta",
                                                          "index": entry["index"], "delta": delta})
            elif kind == "content_block_stop":
                entry = blocks.get(data.get("index"))
                if entry is None:
                    continue
                given = entry["upstream"].get("input")
                ours = entry["shown_start"].get("type") == "server_tool_use"
                if ours and not entry["json"] and given:
                    # An upstream that gave the whole input at the block's start (some
                    # Messages-compatible servers do) sent no deltas: the client's
                    # block starts empty, as Anthropic's does, and gets it as one.
                    entry["json"] = json.dumps(given, ensure_ascii=False)
                    yield self._event("content_block_delta", {
                        "type": "content_block_delta", "index": entry["index"],
                        "delta": {"type": "input_json_delta", "partial_json": entry["json"]}})
                _close(entry)
                yield self._event("content_block_stop", {"type": "content_block_stop",
                                                         "index": entry["index"]})
            elif kind == "message_delta":
                delta = data.get("delta") or {}
                turn.stop_reason = delta.get("stop_reason") or turn.stop_reason
                turn_output = (data.get("usage") or {}).get("output_tokens", turn_output)
            elif kind == "message_stop":
                break
        else:
            # A connection closed mid-answer reads as an ended stream (close-delimited
            # bodies carry no length): without its message_stop it is a broken answer,
            # never one to pass off as complete.
            raise UpstreamError(502, "the upstream model's stream ended before its "
                                     "message_stop: the answer is incomplete")
        self.usage["output_tokens"] += int(turn_output or 0)
        said = []
        for _, entry in sorted(blocks.items()):
            _close(entry)
            said.append(entry["upstream"])
            if entry["upstream"].get("type") == "tool_use":
                turn.tool_uses.append(ToolUse(entry["upstream"]["id"], entry["upstream"]["name"],
                                              entry["upstream"].get("input")))
        if said:
            self.history.append({"role": "assistant", "content": said})
        turn.truncated = turn.stop_reason in _CUT_OFF
        yield turn

    async def run_request(self, use: ToolUse):
        arguments = use.arguments if isinstance(use.arguments, dict) else None
        if arguments is None:
            return _Refusal("invalid_tool_input", "the tool input must be a JSON object")
        container = self.container.id
        if use.name == BASH:
            command = arguments.get("command")
            restart = arguments.get("restart") is True
            if not isinstance(command, str) or (not command.strip() and not restart):
                return _Refusal("invalid_tool_input", "command is required and must be a string")
            timeout = arguments.get("timeout", DEFAULT_BASH_TIMEOUT)
            if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                    or not 0 < timeout < math.inf):
                return _Refusal("invalid_tool_input", "timeout must be a positive number of seconds")
            # The run clamps to its ceiling; a model's 1e308 must reach it as a number.
            timeout_ms = int(min(timeout, MAX_TIMEOUT_MS / 1000) * 1000)
            return RunRequest(language="bash", code=command or "true", container_id=container,
                              timeout_ms=max(1, timeout_ms), caronte_files=False, restart=restart)
        if use.name == EDITOR:
            refusal = _check_editor(arguments)
            if refusal is not None:
                return refusal
            return RunRequest(language="edit", edit=arguments, container_id=container,
                              timeout_ms=DEFAULT_BASH_TIMEOUT * 1000, caronte_files=False)
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return _Refusal("invalid_tool_input", "code is required and must be a string")
        return RunRequest(language="python", code=code, container_id=container,
                          timeout_ms=DEFAULT_BASH_TIMEOUT * 1000, caronte_files=False)

    def refusal(self, reason: str) -> "_Refusal":
        return _Refusal("too_many_requests", reason)

    async def tool_result(self, use: ToolUse, run: Run | None, failure: object) -> list:
        self.executions += 1 if run is not None else 0
        if run is not None and run.result is None:
            failure = _Refusal("unavailable", run.error or "the code could not be run")
        if isinstance(failure, _Refusal):
            inner, feedback = self._error_block(use.name, failure), failure.feedback()
        elif use.name == EDITOR:
            inner, feedback = self._editor_block(run), None
        else:
            inner, feedback = self._output_block(use.name, run), None
        if feedback is None:
            feedback = _feedback(inner, run)
        outer = {BASH: "bash_code_execution_tool_result",
                 EDITOR: "text_editor_code_execution_tool_result"}.get(use.name,
                                                                       "code_execution_tool_result")
        block = {"type": outer, "tool_use_id": use.id, "content": inner}
        self._results.append({"type": "tool_result", "tool_use_id": use.id, **feedback})
        self.content.append(block)
        index = len(self.content) - 1
        return [self._event("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": block}),
                self._event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def finish(self, stop_reason: str) -> list:
        self.stop_reason = stop_reason
        delta = {"stop_reason": stop_reason, "stop_sequence": None, "container": self.container_block()}
        return [self._event("message_delta", {"type": "message_delta", "delta": delta,
                                              "usage": self.final_usage()}),
                self._event("message_stop", {"type": "message_stop"})]

    # -- the client's message ------------------------------------------------------------------
    def container_block(self) -> dict:
        return {"id": self.container.id, "expires_at": rfc3339(self._expiry())}

    def final_usage(self) -> dict:
        return {**self.usage, "server_tool_use": {
            "web_search_requests": 0, "web_fetch_requests": 0,
            "code_execution_requests": self.executions}}

    def message(self) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": self.stop_reason, "stop_sequence": None,
                "usage": self.final_usage(), "container": self.container_block()}

    def _event(self, name: str, data: dict):
        return _sse(name, data) if self.request.stream else None

    def _add_usage(self, usage: dict, include_output: bool) -> None:
        for key, value in usage.items():
            if key == "output_tokens" and not include_output:
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                self.usage[key] = self.usage.get(key, 0) + value

    def _start_block(self, block: dict) -> dict:
        kind = block.get("type")
        upstream = dict(block)
        if kind == "tool_use" and block.get("name") in self.request.code_tools:
            ident = "srvtoolu_" + secrets.token_hex(12)
            upstream["id"] = ident
            shown = {"type": "server_tool_use", "id": ident, "name": block["name"], "input": {}}
        else:
            shown = dict(block)
        self.content.append(dict(shown))
        return {"index": len(self.content) - 1, "upstream": upstream, "shown_start": shown,
                "json": "", "closed": False, "client": self.content[-1]}

    def _error_block(self, name: str, refusal: "_Refusal") -> dict:
        kind = {BASH: "bash_code_execution_tool_result_error",
                EDITOR: "text_editor_code_execution_tool_result_error"}.get(
            name, "code_execution_tool_result_error")
        code = refusal.code
        if code == "file_not_found" and name != EDITOR:
            code = "unavailable"
        block = {"type": kind, "error_code": code}
        if name == EDITOR:
            block["error_message"] = refusal.explanation
        if self.request.mode == ZYLON:
            block["detail"] = {"code": code, "explanation": refusal.explanation}
        return block

    def _output_block(self, name: str, run: Run) -> dict:
        result = run.result
        kind = "bash_code_execution" if name == BASH else "code_execution"
        files = [{"type": f"{kind}_output", "file_id": scoped_file_id(self.container.id, item.path)}
                 for item in run.files]
        return {"type": f"{kind}_result", "stdout": result.stdout, "stderr": result.stderr,
                "return_code": result.return_code, "content": files}

    def _editor_block(self, run: Run) -> dict:
        editor = run.result.editor or {}
        kind = editor.get("kind")
        if kind == "error" or run.result.return_code != 0 and kind is None:
            message = editor.get("error_message") or run.result.stderr or "the edit failed"
            return self._error_block(EDITOR, _Refusal(editor.get("error_code", "unavailable"),
                                                      message))
        if kind == "view":
            file_type = editor.get("file_type")
            return {"type": "text_editor_code_execution_view_result",
                    "file_type": file_type if file_type in ("text", "image", "pdf") else "text",
                    "content": editor.get("content", ""), "num_lines": editor.get("num_lines"),
                    "start_line": editor.get("start_line"), "total_lines": editor.get("total_lines")}
        if kind == "create":
            return {"type": "text_editor_code_execution_create_result",
                    "is_file_update": bool(editor.get("is_file_update"))}
        return {"type": "text_editor_code_execution_str_replace_result",
                **{key: editor.get(key) for key in ("old_start", "old_lines", "new_start",
                                                    "new_lines", "lines")},
                **({"lines": []} if editor.get("lines") is None else {})}


@dataclass(frozen=True)
class _Refusal:
    """A call answered with an error block instead of being run."""

    code: str
    explanation: str

    def feedback(self) -> dict:
        return {"content": f"error: {self.code}: {self.explanation}", "is_error": True}


def _relaxed(choice: object) -> object:
    """The client's tool_choice for the loop's later turns. A forced choice ("any",
    one tool) binds the model's first turn; held on every turn, it forbids the
    answer after the code ran, and the loop called the model until its budget
    ended it, every request, at pause_turn."""
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        return {"type": "auto", **{key: value for key, value in choice.items()
                                   if key == "disable_parallel_tool_use"}}
    return choice


def _check_editor(arguments: dict) -> _Refusal | None:
    command = arguments.get("command")
    if command not in EDITOR_COMMANDS:
        return _Refusal("invalid_tool_input", f"command must be one of {', '.join(EDITOR_COMMANDS)}")
    path = arguments.get("path")
    if not isinstance(path, str) or not path or "\x00" in path:
        return _Refusal("invalid_tool_input", "path is required and must be a string")
    absolute = posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKSPACE, path))
    if not any(absolute == mount or absolute.startswith(mount + "/") for mount in _MOUNTS):
        return _Refusal("invalid_tool_input", f"Path '{path}' does not match any session mount")
    if command in _MODIFYING and any(absolute == mount or absolute.startswith(mount + "/")
                                     for mount in _READ_ONLY):
        return _Refusal("invalid_tool_input", f"Path '{path}' is in a read-only mount")
    return None


def _feedback(inner: dict, run: Run | None) -> dict:
    """What the model is told of a result: the same facts, as text it can read."""
    kind = inner.get("type", "")
    if kind.endswith("_error"):
        explanation = inner.get("error_message") or (inner.get("detail") or {}).get("explanation")
        return {"content": f"error: {inner.get('error_code')}: {explanation or ''}".rstrip(": "),
                "is_error": True}
    if kind in ("bash_code_execution_result", "code_execution_result"):
        text = {"stdout": for_model(inner["stdout"]), "stderr": for_model(inner["stderr"]),
                "return_code": inner["return_code"]}
        if run is not None and run.files:
            text["files"] = [item.path for item in run.files]
        return {"content": json.dumps(text, ensure_ascii=False)}
    if kind == "text_editor_code_execution_view_result" and run is not None:
        return {"content": for_model(run.result.stdout)}
    if run is not None and run.result.stdout:
        return {"content": for_model(run.result.stdout)}
    return {"content": json.dumps({k: v for k, v in inner.items() if k != "type"})}


def _accumulate(entry: dict, delta: dict) -> None:
    """Build the whole block from its deltas, for the history and a JSON answer."""
    kind = delta.get("type")
    upstream, client = entry["upstream"], entry["client"]
    if kind == "text_delta":
        for target in (upstream, client):
            target["text"] = target.get("text", "") + str(delta.get("text", ""))
    elif kind == "input_json_delta":
        entry["json"] += str(delta.get("partial_json", ""))
    elif kind == "thinking_delta":
        for target in (upstream, client):
            target["thinking"] = target.get("thinking", "") + str(delta.get("thinking", ""))
    elif kind == "signature_delta":
        for target in (upstream, client):
            target["signature"] = target.get("signature", "") + str(delta.get("signature", ""))
    elif kind == "citations_delta":
        for target in (upstream, client):
            target.setdefault("citations", []).append(delta.get("citation"))


def _close(entry: dict) -> None:
    if entry["closed"]:
        return
    entry["closed"] = True
    if entry["upstream"].get("type") == "tool_use" and entry["json"]:
        try:
            value = json.loads(entry["json"])
        except ValueError:
            value = {"_unparsable_input": entry["json"]}
        entry["upstream"]["input"] = value
        entry["client"]["input"] = value


def _sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
