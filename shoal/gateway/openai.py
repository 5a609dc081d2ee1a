"""OpenAI's hosted ``code_interpreter`` and Caronte's ``caronte:code_execution``,
served in front of any Responses API model.

For the upstream model both become ordinary function tools (``code_interpreter
{code}`` and ``code_execution {language, code, timeout_ms}``). The client sees
what OpenAI's API would send: ``code_interpreter_call`` items in their place
among the output items (with ``outputs`` only when ``include`` asks for them),
the model's messages, and files the code produced as ``container_file_citation``
annotations on the next message. Caronte's runs stay out of sight; when their
code calls the client's tools (``allowed_tools``), the run pauses and the
response ends with ordinary ``function_call`` items, which the client's next
request answers.

Responses are kept (``store``) with the upstream-facing history behind them,
so ``previous_response_id`` continues a conversation: its containers, and a run
still waiting for tool results.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from shoal.runs import Grant, Run, RunRequest, ToolSpec, normalise_tool
from shoal.runs.broker import InvalidTools
from shoal.runs.manager import (DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS, TooManyFiles,
                                 distinct_file_ids)
from shoal.sessions import ContainerFile
from shoal.sessions.network import InvalidNetworkPolicy, check_network_policy
from shoal.storage import ContainerRecord

from .engine import Paused, ToolUse, Turn, for_model
from .upstream import Timing, Upstream, UpstreamError

CODE_INTERPRETER, CARONTE = "code_interpreter", "caronte:code_execution"
CI_FUNCTION, CARONTE_FUNCTION = "code_interpreter", "code_execution"
INCLUDE_OUTPUTS = "code_interpreter_call.outputs"
SEALED_REASONING = "reasoning.encrypted_content"
_IMAGE_BYTES = 4 * 1024 * 1024
# Images inlined in one response's outputs, in all: every one is base64 in the
# response (held whole, and stored with it). Past these a chart is still cited
# and downloadable, only not inlined.
_IMAGES_PER_RESPONSE = 8
_IMAGE_BYTES_PER_RESPONSE = 16 * 1024 * 1024
_LAYOUT = ("Files uploaded by the user are in /mnt/user-data/uploads/ (read-only); save files you "
           "create to /mnt/data/ so the user can download them. There is no internet access. "
           "Python 3 has pandas, numpy, scipy, scikit-learn, matplotlib, seaborn, openpyxl, "
           "python-docx, reportlab and more.")
UPSTREAM_TOOLS = {
    CI_FUNCTION: {"type": "function", "name": CI_FUNCTION, "strict": False, "description": (
        "Run Python code in a stateful Jupyter-like interpreter in a sandboxed container: "
        "variables persist between calls and the value of the last expression is printed. "
        + _LAYOUT), "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"]}},
    CARONTE_FUNCTION: {"type": "function", "name": CARONTE_FUNCTION, "strict": False, "description": (
        "Run a Python or JavaScript (Bun) snippet in a sandboxed runtime and get its stdout, "
        "stderr, exit code and generated files. Files of the container are read-only under "
        "./external-files/; files the snippet writes at the top level of its working directory "
        "are kept and returned. No network access."),
        "parameters": {"type": "object", "properties": {
            "language": {"type": "string", "enum": ["python", "javascript"]},
            "code": {"type": "string"},
            "timeout_ms": {"type": "integer", "description": "Wall-clock cap, default 30000, "
                                                             "max 300000."}},
            "required": ["code"]}},
}


class InvalidResponsesRequest(ValueError):
    """A request that cannot be served as asked (a 400 with this reason)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ResponsesRequest:
    body: dict
    stream: bool
    include_outputs: bool
    code_interpreter: dict | None
    caronte: dict | None
    function_tools: list[dict]
    items: list[dict]
    previous_response_id: str | None
    store: bool
    # The function tools Caronte's code may call (its allowed_tools), checked.
    code_tools: list[ToolSpec] = field(default_factory=list)


def parse_request(body: dict, continuing: bool = False) -> ResponsesRequest | None:
    """The parsed request, or None when it has no code tool (pass it through).
    ``continuing``: it continues a conversation held here, code tool or not."""
    tools = body.get("tools")
    if tools is None and continuing:
        tools = []
    if not isinstance(tools, list):
        return None
    kinds = [tool.get("type") for tool in tools if isinstance(tool, dict)]
    if CODE_INTERPRETER not in kinds and CARONTE not in kinds and not continuing:
        return None  # not ours to judge: the upstream answers it as it would
    for tool in tools:  # what the loop reads of the tools has the types it reads
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise InvalidResponsesRequest("each tool must be an object with a string type", "tools")
        if tool.get("name") is not None and not isinstance(tool["name"], str):
            raise InvalidResponsesRequest("a tool's name must be a string", "tools")
    if kinds.count(CODE_INTERPRETER) > 1 or kinds.count(CARONTE) > 1:
        raise InvalidResponsesRequest("give each code tool at most once", "tools")
    interpreter = next((t for t in tools if t.get("type") == CODE_INTERPRETER), None)
    caronte = next((t for t in tools if t.get("type") == CARONTE), None)
    if interpreter is not None:
        container = interpreter.get("container")
        if container is None:
            interpreter = {**interpreter, "container": {"type": "auto"}}
        elif isinstance(container, dict):
            if container.get("type", "auto") != "auto":
                raise InvalidResponsesRequest("code_interpreter.container must be a container id "
                                              "or {\"type\": \"auto\"}", "tools")
            try:
                check_network_policy(container.get("network_policy"))
            except InvalidNetworkPolicy as exc:
                raise InvalidResponsesRequest(str(exc), "tools") from None
            file_ids = container.get("file_ids")
            if file_ids is not None and not (isinstance(file_ids, list)
                                             and all(isinstance(f, str) for f in file_ids)):
                raise InvalidResponsesRequest("code_interpreter.container.file_ids must be a "
                                              "list of file ids", "tools")
            if file_ids:
                interpreter = {**interpreter, "container": {
                    **container, "file_ids": _distinct(file_ids, "code_interpreter.container")}}
        elif not isinstance(container, str) or not container:
            raise InvalidResponsesRequest("code_interpreter.container must be a container id "
                                          "or {\"type\": \"auto\"}", "tools")
    if caronte is not None:
        for key in ("container",):
            if caronte.get(key) is not None and not isinstance(caronte.get(key), str):
                raise InvalidResponsesRequest(f"{CARONTE}.{key} must be a string", "tools")
        for key in ("file_ids", "allowed_tools"):
            value = caronte.get(key)
            if value is not None and not (isinstance(value, list)
                                          and all(isinstance(v, str) for v in value)):
                raise InvalidResponsesRequest(f"{CARONTE}.{key} must be a list of strings", "tools")
        if caronte.get("file_ids"):
            caronte = {**caronte, "file_ids": _distinct(caronte["file_ids"], CARONTE)}
    function_tools = [t for t in tools if isinstance(t, dict) and t.get("type") == "function"]
    for tool in function_tools:
        if tool.get("name") in UPSTREAM_TOOLS:
            raise InvalidResponsesRequest(f"a function tool named {tool.get('name')!r} clashes with "
                                          "the code tool", "tools")
    code_tools = _code_tools(function_tools, (caronte or {}).get("allowed_tools") or [])
    raw = body.get("input")
    if isinstance(raw, str):
        items = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list) and all(isinstance(item, dict) for item in raw):
        items = raw
    elif raw is None and body.get("previous_response_id"):
        items = []
    else:
        raise InvalidResponsesRequest("input must be a string or a list of items", "input")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise InvalidResponsesRequest("stream must be true or false", "stream")
    include = body.get("include")
    include = [] if include is None else include
    if not isinstance(include, list):
        raise InvalidResponsesRequest("include must be a list", "include")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidResponsesRequest("previous_response_id must be a string", "previous_response_id")
    calls = body.get("max_tool_calls")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
        raise InvalidResponsesRequest("max_tool_calls must be a non-negative integer",
                                      "max_tool_calls")
    if body.get("conversation") is not None:
        # The loop's model calls keep nothing upstream (store:false), so they can
        # neither read the conversation nor add to it: dropped, the model answered
        # without the conversation's context, and nothing said so.
        raise InvalidResponsesRequest("conversation is not supported with the code tools served "
                                      "here; continue with previous_response_id", "conversation")
    return ResponsesRequest(body=body, stream=body.get("stream") is True,
                            include_outputs=isinstance(include, list) and INCLUDE_OUTPUTS in include,
                            code_interpreter=interpreter, caronte=caronte,
                            function_tools=function_tools, items=items,
                            previous_response_id=previous, store=body.get("store") is not False,
                            code_tools=code_tools)


def _distinct(file_ids: list[str], where: str) -> list[str]:
    """Each id once, in order; a 400 past what one request may attach (each is a
    copy into the container, and one id named 3,000 times was 3,000 copies)."""
    try:
        return distinct_file_ids(file_ids)
    except TooManyFiles as exc:
        raise InvalidResponsesRequest(f"{where}.file_ids {exc}", "tools") from None


def _code_tools(function_tools: list[dict], allowed: list[str]) -> list[ToolSpec]:
    """The tools ``allowed_tools`` lets Caronte's code call, each schema usable by
    the host's broker (which checks every call's arguments against it): refused
    with the request, before the model is asked, not as a failed run it cannot
    fix. The model's own tools are the model's: their schemas are not ours to judge."""
    if not allowed:
        return []
    try:
        tools = [normalise_tool(tool) for tool in function_tools if tool.get("name") in allowed]
        Grant(tools, allowed)  # every allowed name declared, once
    except InvalidTools as exc:
        raise InvalidResponsesRequest(f"{CARONTE}.allowed_tools: {exc}", "tools") from None
    return tools


def upstream_items(items: list[dict]) -> list[dict]:
    """Client input items as the upstream understands them: a code_interpreter_call
    it was sent back becomes the function call and output the model made."""
    mapped = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "code_interpreter_call":
            call_id = str(item.get("id") or "ci_" + secrets.token_hex(8))
            mapped.append({"type": "function_call", "call_id": call_id, "name": CI_FUNCTION,
                           "arguments": json.dumps({"code": item.get("code") or ""})})
            outputs = item.get("outputs") if isinstance(item.get("outputs"), list) else []
            logs = "".join(o["logs"] for o in outputs if isinstance(o, dict)
                           and o.get("type") == "logs" and isinstance(o.get("logs"), str))
            mapped.append({"type": "function_call_output", "call_id": call_id,
                           "output": for_model(logs) or "(the call's output was not sent back)"})
        elif kind == "message" and item.get("role") == "assistant" and isinstance(
                item.get("content"), list):
            mapped.append({key: value for key, value in item.items() if value is not None
                           and key != "content"} | {"content": [
                               {k: ([] if k == "annotations" else v) for k, v in part.items()
                                if v is not None} for part in item["content"] if isinstance(part, dict)]})
        elif not _unsendable(item):
            mapped.append({key: value for key, value in item.items()
                           if key not in ("parsed", "parsed_arguments")})
    return mapped


# -- the loop's adapter ------------------------------------------------------------------------------
@dataclass
class Conversation:
    """What a response continues from: the upstream history and its containers."""

    history: list[dict] = field(default_factory=list)
    interpreter_container: str | None = None
    caronte_container: str | None = None
    # The uploads (file ids) copied into each of its containers so far, by container id.
    attached: dict[str, list[str]] = field(default_factory=dict)

    def not_attached(self, container_id: str, file_ids: list[str]) -> list[str]:
        done = self.attached.get(container_id) or []
        return [file_id for file_id in file_ids if file_id not in done]

    def mark_attached(self, container_id: str, file_ids: list[str]) -> None:
        done = self.attached.setdefault(container_id, [])
        done.extend(file_id for file_id in file_ids if file_id not in done)

    def interpreter_container_id(self) -> str:
        """The interpreter's container id, chosen before the container is made:
        the client is told it as soon as the model starts a call."""
        if self.interpreter_container is None:
            self.interpreter_container = "cnt_" + secrets.token_hex(12)
        return self.interpreter_container


class OpenAIAdapter:
    def __init__(self, request: ResponsesRequest, upstream: Upstream, conversation: Conversation,
                 containers, read_file, incoming: dict[str, str]) -> None:
        self.request = request
        self.upstream = upstream
        self.timing = Timing()
        self.conversation = conversation
        # async (kind, tool) -> ContainerRecord | None: a call's container, made when first needed
        self._containers = containers
        # async (container id, ContainerFile) -> bytes: an image to inline
        self._read_file = read_file
        self.incoming = incoming
        self.response_id = "resp_" + secrets.token_hex(24)
        self.created_at = int(time.time())
        self.model = request.body.get("model")
        body = {key: value for key, value in request.body.items()
                if key not in ("input", "tools", "previous_response_id", "include", "store",
                               "stream", "background", "conversation")}
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == CODE_INTERPRETER:
            body["tool_choice"] = {"type": "function", "name": CI_FUNCTION}
        # The loop's calls are "store": false: a reasoning item goes back to the
        # model only with its encrypted content, asked for when the client asks
        # for reasoning (a model that does not reason may refuse the include).
        include = [name for name in request.body.get("include") or []
                   if isinstance(name, str) and name != INCLUDE_OUTPUTS]
        if isinstance(body.get("reasoning"), dict) and SEALED_REASONING not in include:
            include.append(SEALED_REASONING)
        if include:
            body["include"] = include
        self.base_body = body
        names = []
        if request.code_interpreter is not None:
            names.append(CI_FUNCTION)
        if request.caronte is not None:
            names.append(CARONTE_FUNCTION)
        self.code_names = set(names)
        other_tools = [tool for tool in request.body.get("tools") or []
                       if tool.get("type") not in (CODE_INTERPRETER, CARONTE)]
        self.upstream_tools = other_tools + [UPSTREAM_TOOLS[name] for name in names]
        self.output: list[dict] = []
        self.usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.pending_calls: list[dict] = []  # function_call items of a paused run
        self._sequence = 0
        self._started = False
        self._asked = False  # the upstream was called once already
        self._uncited: list[ContainerFile] = []
        self._inlined = self._inlined_bytes = 0
        self._cited_containers: dict[str, str] = {}
        self._outputs: list[dict] = []  # function_call_output items not yet sent upstream
        self._ci_items: dict[str, dict] = {}

    # -- the engine's interface ------------------------------------------------------------------
    def is_code_tool(self, name: str) -> bool:
        return name in self.code_names

    def keepalive(self):
        return b": keep-alive\n\n" if self.request.stream else None

    def start(self) -> list:
        if self._started:
            return []
        self._started = True
        snapshot = self.response(status="in_progress", output=[])
        return [self._event("response.created", {"response": snapshot}),
                self._event("response.in_progress", {"response": snapshot})]

    async def upstream_turn(self) -> AsyncIterator[object]:
        # response.created goes out once the upstream has answered: an upstream
        # that refuses is then still the client's error status, not a stream.
        self.conversation.history.extend(self._outputs)
        self._outputs = []
        body = {**self.base_body, "input": self.conversation.history, "tools": self.upstream_tools,
                "store": False}
        if self._asked and "tool_choice" in body:
            body["tool_choice"] = _relaxed(body["tool_choice"])
        self._asked = True
        turn = Turn()
        items: dict[int, dict] = {}
        completed = None
        async for name, data in self.upstream.events("/v1/responses", body, self.incoming, self.timing):
            for event in self.start():
                yield event
            kind = data.get("type", name)
            index = data.get("output_index")
            if kind == "response.output_item.added":
                entry = self._added(data.get("item") or {})
                items[index] = entry
                if entry["shown"] is not None:
                    yield self._event("response.output_item.added",
                                      {"output_index": entry["index"], "item": entry["shown"]})
                    if entry["kind"] == "interpreter":
                        yield self._event("response.code_interpreter_call.in_progress",
                                          {"output_index": entry["index"],
                                           "item_id": entry["shown"]["id"]})
            elif kind == "response.output_item.done":
                entry = items.get(index)
                if entry is None:
                    continue
                entry["item"] = data.get("item") or entry["item"]
                if entry["kind"] == "message":
                    item = self._cite(entry)
                    entry["item"] = item
                    self._replace(entry["index"], item)
                    yield self._event("response.output_item.done",
                                      {"output_index": entry["index"], "item": item})
                elif entry["kind"] == "client":
                    self._replace(entry["index"], entry["item"])
                    yield self._event("response.output_item.done",
                                      {"output_index": entry["index"], "item": entry["item"]})
            elif kind == "response.output_text.done":
                entry = items.get(index)
                if entry is not None and entry["kind"] == "message":
                    for event in self._annotations(entry, data):
                        yield event
                    yield self._forward(kind, data, entry)
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                completed = data.get("response") or {}
                break
            elif kind.startswith("response.") and index is not None:
                entry = items.get(index)
                if entry is None or entry["kind"] in ("interpreter", "hidden"):
                    if entry is not None and kind == "response.function_call_arguments.done":
                        entry["arguments"] = data.get("arguments", "")
                    continue
                if kind == "response.content_part.done" and entry["kind"] == "message":
                    data = {**data, "part": self._cited_part(entry, data)}
                yield self._forward(kind, data, entry)
        else:
            # A connection closed mid-answer reads as an ended stream: without its
            # final event it is a broken answer, never one to store as completed.
            raise UpstreamError(502, "the upstream model's stream ended before its final "
                                     "event: the response is incomplete")
        if kind == "response.failed" or completed.get("status") == "failed":
            # The model's own failure: what it said before failing is not an
            # answer, and must not be kept or shown as a completed response.
            raise _upstream_failure(completed.get("error"))
        self._add_usage(completed.get("usage") or {})
        final_items = completed.get("output")
        if isinstance(final_items, list) and final_items:
            by_id = {item.get("id"): item for item in final_items if isinstance(item, dict)}
            for entry in items.values():
                entry["item"] = by_id.get(entry["item"].get("id"), entry["item"])
        for _, entry in sorted(items.items()):
            item = entry["item"]
            kept = _history_item(item)
            if kept is not None:
                self.conversation.history.append(kept)
            if item.get("type") == "function_call":
                arguments = item.get("arguments") or entry.get("arguments") or "{}"
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                turn.tool_uses.append(ToolUse(item.get("call_id") or item.get("id", ""),
                                              item.get("name", ""), parsed))
                if entry["kind"] == "interpreter":
                    entry["shown"]["code"] = (parsed or {}).get("code", "") if isinstance(
                        parsed, dict) else ""
                    self._ci_items[turn.tool_uses[-1].id] = entry
        if completed.get("status") == "incomplete":
            self.incomplete = completed.get("incomplete_details")
            turn.stop_reason = "incomplete"
            turn.truncated = True
            for use in turn.tool_uses:
                if use.name not in self.code_names:
                    continue
                # Not run; answered, so that a continuation's history is one the
                # upstream accepts (every call with its output).
                self._outputs.append({"type": "function_call_output", "call_id": use.id,
                                      "output": "error: the call was cut off at the output "
                                                "limit and was not run"})
                entry = self._ci_items.get(use.id)
                if entry is not None:
                    entry["shown"]["status"] = "incomplete"
                    yield self._event("response.output_item.done", {
                        "output_index": entry["index"], "item": entry["shown"]})
        yield turn

    async def run_request(self, use: ToolUse):
        arguments = use.arguments if isinstance(use.arguments, dict) else None
        if arguments is None or not isinstance(arguments.get("code"), str):
            return _Refusal("the call's arguments must be a JSON object with a string 'code'")
        if use.name == CI_FUNCTION:
            # An auto container is made here, when the model first calls the tool.
            container = await self._containers("interpreter", self.request.code_interpreter)
            self.conversation.interpreter_container = container.id
            return RunRequest(language="python", code=arguments["code"], container_id=container.id,
                              timeout_ms=DEFAULT_TIMEOUT_MS * 2, caronte_files=False)
        language = arguments.get("language", "python")
        if language not in ("python", "javascript"):
            return _Refusal("language must be python or javascript")
        timeout = arguments.get("timeout_ms", DEFAULT_TIMEOUT_MS)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            timeout = DEFAULT_TIMEOUT_MS
        arguments = {**arguments, "language": language, "timeout_ms": min(timeout, MAX_TIMEOUT_MS)}
        marker = self.request.caronte or {}
        container = await self._containers("caronte", marker)
        # Mounted in the container once each: a follow-up's new files too (they were
        # given to a conversation's first run only, and a later one went missing).
        file_ids = list(marker.get("file_ids") or [])
        if container is not None:
            file_ids = self.conversation.not_attached(container.id, file_ids)
        return RunRequest(language=arguments["language"], code=arguments["code"],
                          tools=list(self.request.code_tools),
                          allowed_tools=list(marker.get("allowed_tools") or []),
                          container_id=container.id if container else None,
                          file_ids=file_ids,
                          timeout_ms=arguments["timeout_ms"], caronte_files=True)

    def refusal(self, reason: str) -> "_Refusal":
        return _Refusal(reason)

    async def tool_result(self, use: ToolUse, run: Run | None, failure: object) -> list:
        events = self.start()
        if use.name == CI_FUNCTION:
            images = []
            if self.request.include_outputs and run is not None and run.container is not None:
                for item in run.files:
                    size = item.record.size
                    if (item.mime_type == "image/png" and size <= _IMAGE_BYTES
                            and self._inlined < _IMAGES_PER_RESPONSE
                            and self._inlined_bytes + size <= _IMAGE_BYTES_PER_RESPONSE):
                        images.append(await self._read_file(run.container.id, item))
                        self._inlined += 1
                        self._inlined_bytes += size
            events += self._interpreter_done(use, run, failure, images)
            output = _interpreter_feedback(run, failure)
        else:
            output = json.dumps(_record_for_model(run) if run is not None else {
                "status": "failed", "error": getattr(failure, "reason", "the run could not start")},
                ensure_ascii=False)
            if run is not None and run.container is not None:
                self.conversation.caronte_container = run.container.id
                self.conversation.mark_attached(run.container.id, run.request.file_ids)
        if run is not None:
            self._uncited.extend(run.files)
            if run.container is not None:
                for item in run.files:
                    self._cited_containers[item.id] = run.container.id
        self._outputs.append({"type": "function_call_output", "call_id": use.id, "output": output})
        return events

    def paused(self, pause: Paused) -> list:
        """The run's code waits on client tools: the response ends with those calls."""
        events = self.start()
        for call in pause.run.waiting:
            item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call",
                    "call_id": call.call_id, "name": call.name,
                    "arguments": json.dumps(call.arguments, ensure_ascii=False), "status": "completed"}
            self.pending_calls.append(item)
            self.output.append(item)
            index = len(self.output) - 1
            events += [self._event("response.output_item.added", {"output_index": index,
                                                                  "item": {**item, "arguments": ""}}),
                       self._event("response.function_call_arguments.done",
                                   {"output_index": index, "item_id": item["id"],
                                    "arguments": item["arguments"]}),
                       self._event("response.output_item.done", {"output_index": index,
                                                                 "item": item})]
        return events + self.finish("tool_use")

    def finish(self, stop_reason: str) -> list:
        if stop_reason == "pause_turn":
            self.status, self.incomplete = "incomplete", {"reason": "max_tool_calls"}
        elif stop_reason == "incomplete":
            self.status = "incomplete"
        else:
            self.status = "completed"
        events = self.start()
        final = self.response()
        events.append(self._event(f"response.{'completed' if self.status == 'completed' else 'incomplete'}",
                                  {"response": final}))
        return events

    def failure(self, message: str, code: str = "server_error") -> list:
        """The closing events of a response that broke off in the middle."""
        self.status = "failed"
        # A response's error code is one of OpenAI's closed set; the event's is free.
        kind = code if code in ("rate_limit_exceeded", "server_error") else "server_error"
        failed = {**self.response(), "error": {"code": kind, "message": message}}
        return [self._event("error", {"code": code, "message": message, "param": None}),
                self._event("response.failed", {"response": failed})]

    def pending_outputs(self) -> list[dict]:
        """Results not yet sent upstream (a paused turn): the next request sends them."""
        return list(self._outputs)

    # -- the client's response ---------------------------------------------------------------------
    def response(self, status: str | None = None, output: list | None = None) -> dict:
        body = self.request.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status or self.status, "model": self.model,
            "output": self.output if output is None else output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            # Caronte's marker is not a tool type OpenAI's SDKs know: echoing it
            # would fail a strictly validating client.
            "tools": [tool for tool in body.get("tools", []) if tool.get("type") != CARONTE],
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "previous_response_id": self.request.previous_response_id,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "store": self.request.store, "error": None,
            "incomplete_details": self.incomplete if (status or self.status) == "incomplete" else None,
            "usage": self.usage if (status or self.status) != "in_progress" else None,
            "text": body.get("text", {"format": {"type": "text"}}),
            "truncation": body.get("truncation", "disabled"),
        }

    def _event(self, kind: str, data: dict):
        if not self.request.stream:
            return None
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def _forward(self, kind: str, data: dict, entry: dict):
        fields = {key: value for key, value in data.items() if key not in ("type", "sequence_number")}
        fields["output_index"] = entry["index"]
        return self._event(kind, fields)

    def _added(self, item: dict) -> dict:
        kind = item.get("type")
        if kind == "function_call" and item.get("name") == CI_FUNCTION and CI_FUNCTION in self.code_names:
            shown = {"id": "ci_" + secrets.token_hex(12), "type": "code_interpreter_call",
                     "status": "in_progress", "code": "",
                     "container_id": self.conversation.interpreter_container_id(), "outputs": None}
            self.output.append(shown)
            return {"kind": "interpreter", "item": dict(item), "shown": shown,
                    "index": len(self.output) - 1}
        if kind == "function_call" and item.get("name") in self.code_names:
            return {"kind": "hidden", "item": dict(item), "shown": None, "index": None}
        shown = dict(item)
        self.output.append(shown)
        return {"kind": "message" if kind == "message" else "client", "item": dict(item),
                "shown": shown, "index": len(self.output) - 1}

    def _replace(self, index: int, item: dict) -> None:
        self.output[index] = item

    def _interpreter_done(self, use: ToolUse, run: Run | None, failure: object,
                          images: list[bytes]) -> list:
        entry = self._ci_items.get(use.id)
        if entry is None:
            return []
        shown = entry["shown"]
        index = entry["index"]
        shown["container_id"] = self.conversation.interpreter_container
        shown["status"] = "completed" if run is not None and run.result is not None else "failed"
        if self.request.include_outputs:
            shown["outputs"] = _interpreter_outputs(run, failure, images)
        events = [self._event("response.code_interpreter_call_code.delta",
                              {"output_index": index, "item_id": shown["id"], "delta": shown["code"]}),
                  self._event("response.code_interpreter_call_code.done",
                              {"output_index": index, "item_id": shown["id"], "code": shown["code"]}),
                  self._event("response.code_interpreter_call.interpreting",
                              {"output_index": index, "item_id": shown["id"]}),
                  self._event("response.code_interpreter_call.completed",
                              {"output_index": index, "item_id": shown["id"]}),
                  self._event("response.output_item.done", {"output_index": index, "item": shown})]
        return events

    # -- citations ----------------------------------------------------------------------------------
    def _citations(self, text: str) -> list[dict]:
        annotations = []
        for item in self._uncited:
            name = item.filename
            start, end = _mention(text, item)
            annotations.append({"type": "container_file_citation",
                                "container_id": self._cited_containers.get(item.id),
                                "file_id": "cfile_" + item.id, "filename": name,
                                "start_index": start, "end_index": end})
        return annotations

    def _annotations(self, entry: dict, data: dict) -> list:
        """At a text's end: the citations of files produced since the last message."""
        if not self._uncited:
            return []
        content_index = data.get("content_index", 0)
        annotations = self._citations(data.get("text", ""))
        entry.setdefault("annotations", {})[content_index] = annotations
        self._uncited = []
        return [self._event("response.output_text.annotation.added", {
            "item_id": data.get("item_id"), "output_index": entry["index"],
            "content_index": content_index, "annotation_index": number,
            "annotation": annotation}) for number, annotation in enumerate(annotations)]

    @staticmethod
    def _with_annotations(part: dict, annotations: list[dict] | None) -> dict:
        if not annotations or part.get("type") != "output_text":
            return part
        return {**part, "annotations": list(part.get("annotations") or []) + annotations}

    def _cited_part(self, entry: dict, data: dict) -> dict:
        annotations = entry.get("annotations", {}).get(data.get("content_index", 0))
        return self._with_annotations(data.get("part") or {}, annotations)

    def _cite(self, entry: dict) -> dict:
        """A finished message with its file citations on its output_text."""
        item = entry["item"]
        content = item.get("content")
        if not isinstance(content, list):
            return item
        known = entry.get("annotations", {})
        return {**item, "content": [self._with_annotations(part, known.get(number))
                                    if isinstance(part, dict) else part
                                    for number, part in enumerate(content)]}

    def _add_usage(self, usage: dict) -> None:
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            value = usage.get(key)
            if isinstance(value, int):
                self.usage[key] += value
        details = usage.get("input_tokens_details") or {}
        for key in ("cached_tokens", "cache_write_tokens"):
            if isinstance(details.get(key), int):
                self.usage["input_tokens_details"][key] += details[key]
        reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens")
        if isinstance(reasoning, int):
            self.usage["output_tokens_details"]["reasoning_tokens"] += reasoning


@dataclass(frozen=True)
class _Refusal:
    reason: str


def _upstream_failure(error: object) -> UpstreamError:
    """An upstream ``response.failed`` as the error the client is answered with."""
    error = error if isinstance(error, dict) else {}
    code = error.get("code") if isinstance(error.get("code"), str) else None
    message = error.get("message") if isinstance(error.get("message"), str) else None
    # OpenAI's other codes (invalid_prompt, the image ones) are the request's fault.
    status = (429 if code == "rate_limit_exceeded"
              else 502 if code in (None, "server_error", "vector_store_timeout") else 400)
    message = message or "the upstream model failed to answer"
    return UpstreamError(status, {"error": {
        "message": message, "type": "invalid_request_error" if status == 400 else (
            "rate_limit_error" if status == 429 else "server_error"),
        "param": None, "code": code or "server_error"}})


def _history_item(item: dict) -> dict | None:
    """An upstream output item as the next upstream call's input (None: not sent)."""
    if _unsendable(item):
        return None
    if item.get("type") == "function_call":
        return {key: item[key] for key in ("type", "id", "call_id", "name", "arguments")
                if item.get(key) is not None}
    if item.get("type") == "message":
        return {"type": "message", "role": item.get("role", "assistant"), "id": item.get("id"),
                "status": item.get("status", "completed"),
                "content": [{**part, "annotations": []} if part.get("type") == "output_text" else part
                            for part in item.get("content") or [] if isinstance(part, dict)]}
    return {key: value for key, value in item.items() if value is not None}


def _relaxed(choice: object) -> object:
    """The client's tool_choice for the loop's later turns. A forced choice
    ("required", one tool) binds the model's first turn; held on every turn, it
    forbids the answer after the code ran, and the loop called the model until
    its budget ended it, every request, as incomplete."""
    if choice == "required":
        return "auto"
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            return {**choice, "mode": "auto"}
        return "auto"
    return choice


def _record_for_model(run: Run) -> dict:
    record = run.record()
    return {**record, "stdout": for_model(record["stdout"]), "stderr": for_model(record["stderr"])}


def _unsendable(item: dict) -> bool:
    """A reasoning item without its encrypted content: with "store": false the
    upstream has no item of that id, and answers 404 for it (dropped, the model
    goes on without its earlier reasoning)."""
    return item.get("type") == "reasoning" and not item.get("encrypted_content")


def _mention(text: str, item: ContainerFile) -> tuple[int, int]:
    """Where the text names the file (a sandbox link, its path, or its name), else its end."""
    for pattern in (rf"sandbox:/mnt/data/{re.escape(item.filename)}",
                    re.escape(item.path), rf"/mnt/data/{re.escape(item.filename)}",
                    re.escape(item.filename)):
        found = re.search(pattern, text)
        if found:
            return found.start(), found.end()
    return len(text), len(text)


def _interpreter_outputs(run: Run | None, failure: object, images: list[bytes]) -> list[dict]:
    if run is None or run.result is None:
        return [{"type": "logs", "logs": getattr(failure, "reason", None) or (
            run.error if run is not None else "the code could not be run")}]
    result = run.result
    outputs = []
    logs = result.stdout + (result.stderr if result.stderr else "")
    if logs:
        outputs.append({"type": "logs", "logs": logs})
    for data in images:
        outputs.append({"type": "image", "url": "data:image/png;base64," + base64.b64encode(data).decode()})
    return outputs


def _interpreter_feedback(run: Run | None, failure: object) -> str:
    if run is None or run.result is None:
        return "error: " + (getattr(failure, "reason", None) or (
            run.error if run is not None else "the code could not be run"))
    result = run.result
    text = for_model(result.stdout)
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + for_model(result.stderr)
    if result.timed_out:
        text += "\n[the code timed out]"
    files = [f"/mnt/data/{item.filename}" if item.path.startswith("/mnt/user-data/outputs/")
             else item.path for item in run.files]
    if files:
        text += "\n[files: " + ", ".join(files) + "]"
    return text or "(no output)"
