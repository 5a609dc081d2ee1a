"""Inner tool calls as the sandbox layer sees them: checked, handed up, answered.

Code in a sandbox calls a stub; the agent sends the call over the channel; the
host gets it here. This layer only checks that a request is well formed and
bounded, hands it to whatever handler the layer above gave the call (the
runs layer's broker), answers the agent when the handler's result comes, and
keeps the call's clock stopped while any answer is outstanding. Whether a
tool may be called, and with which arguments, is the handler's business.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Protocol

log = logging.getLogger("shoal.sandbox")

MAX_CALLS_PER_BATCH = 64
MAX_CALLS_PER_CALL = 1000
_MAX_NAME = 128
_MAX_REF = 32


@dataclass(frozen=True)
class ToolCall:
    """One call a stub made: the agent's reference for it, the tool, its arguments."""

    ref: str
    name: str
    arguments: object


@dataclass(frozen=True)
class ToolOutcome:
    """What goes back to the stub: an output, or an error it raises."""

    output: object = None
    error: str | None = None


class ToolHandler(Protocol):
    """Implemented by the layer above for one call: decides and answers."""

    #: How long one call may wait for its answer before it fails.
    wait_limit: float

    def submit(self, calls: list[ToolCall]) -> list[Awaitable[ToolOutcome]]:
        """Take a batch of calls made together; one awaitable outcome per call."""


@dataclass
class StubSpec:
    """Stubs a call gets: the tools, and whether they live in a module instead of globals."""

    tools: list[dict]
    module: str | None = None

    def message_fields(self) -> dict:
        fields = {"tools": self.tools}
        if self.module:
            fields["tool_module"] = self.module
        return fields


def parse_calls(raw: list) -> tuple[list[ToolCall], list[str]]:
    """The well-formed calls of a batch, and the refs of malformed ones (answered
    with an error); anything without a usable ref is dropped."""
    calls, malformed = [], []
    for entry in raw[:MAX_CALLS_PER_BATCH]:
        if not isinstance(entry, dict):
            continue
        ref = entry.get("ref")
        if not isinstance(ref, str) or not 0 < len(ref) <= _MAX_REF:
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            malformed.append(ref)
            continue
        calls.append(ToolCall(ref, name, entry.get("arguments")))
    return calls, malformed


@dataclass
class ToolExchange:
    """The tool traffic of one running call: outstanding answers, and the clock."""

    send: "callable"
    call_id: int
    handler: ToolHandler | None
    scope: asyncio.Timeout | None = None
    made: int = 0
    _pending: set = field(default_factory=set)
    _tasks: set = field(default_factory=set)
    _remaining: float = 0.0

    def on_batch(self, raw: list) -> None:
        calls, malformed = parse_calls(raw)
        calls = [call for call in calls if call.ref not in self._pending]
        room = MAX_CALLS_PER_CALL - self.made
        refused = [call.ref for call in calls[max(room, 0):]]
        calls = calls[:max(room, 0)]
        for ref in malformed:
            self._spawn(ref, _done(ToolOutcome(error="malformed tool call")))
        for ref in refused:
            self._spawn(ref, _done(ToolOutcome(
                error=f"at most {MAX_CALLS_PER_CALL} tool calls are allowed per call")))
        if not calls:
            return
        self.made += len(calls)
        if self.handler is None:
            outcomes = [_done(ToolOutcome(error="no tools are available to this code"))
                        for _ in calls]
        else:
            try:
                outcomes = list(self.handler.submit(calls))
            except Exception as exc:  # a handler bug must not kill the call
                log.exception("tool handler failed")
                outcomes = [_done(ToolOutcome(error=f"tool call failed: {exc}")) for _ in calls]
        for call, outcome in zip(calls, outcomes):
            self._spawn(call.ref, outcome, counted=True)

    def _spawn(self, ref: str, outcome: Awaitable[ToolOutcome], counted: bool = False) -> None:
        if counted:
            if not self._pending:
                self._pause()
            self._pending.add(ref)
        task = asyncio.ensure_future(self._answer(ref, outcome, counted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, ref: str, outcome: Awaitable[ToolOutcome], counted: bool) -> None:
        wait_limit = self.handler.wait_limit if self.handler is not None else 1.0
        try:
            try:
                result = await asyncio.wait_for(outcome, wait_limit)
            except asyncio.TimeoutError:
                result = ToolOutcome(error=f"no result arrived within {wait_limit:g}s")
            message = {"op": "tool_result", "id": self.call_id, "ref": ref}
            if result.error is not None:
                message["error"] = result.error
            else:
                message["output"] = _jsonable(result.output)
            try:
                await self.send(message)
            except Exception:  # noqa: BLE001 - the call ends on its own if the channel died
                pass
        finally:
            if counted:
                self._pending.discard(ref)
                if not self._pending:
                    self._resume()

    # -- the clock: time spent waiting for answers is not the code's ---------------------
    def _pause(self) -> None:
        if self.scope is None or self.scope.when() is None:
            return
        loop = asyncio.get_running_loop()
        self._remaining = max(0.0, self.scope.when() - loop.time())
        wait_limit = self.handler.wait_limit if self.handler is not None else 1.0
        self.scope.reschedule(loop.time() + wait_limit + self._remaining + 5.0)

    def _resume(self) -> None:
        if self.scope is None or self.scope.expired():
            return
        self.scope.reschedule(asyncio.get_running_loop().time() + self._remaining)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


async def _done(outcome: ToolOutcome) -> ToolOutcome:
    return outcome


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
