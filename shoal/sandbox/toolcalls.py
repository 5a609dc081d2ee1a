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

from shoal.agent.protocol import MAX_FRAME_BYTES

from .channel import CallTooLarge

log = logging.getLogger("shoal.sandbox")

MAX_CALLS_PER_CALL = 1000
# Refusals answered per call (malformed entries, calls past the cap): each is a
# frame back to the agent, and code can forge entries by the hundred thousand.
MAX_REFUSALS_PER_CALL = 1000
_MAX_NAME = 128
_MAX_REF = 32
MiB = 1024 * 1024
# A result travels to the agent in one frame, beside its envelope.
MAX_RESULT_BYTES = MAX_FRAME_BYTES - 64 * 1024


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


def parse_calls(raw: list) -> tuple[list[ToolCall], list[tuple[str, str]]]:
    """The well-formed calls of a batch, and the refs of the others with why
    (each answered with that error); anything without a usable ref has no one
    to answer and is dropped. A batch is every call the code made at once (a
    Promise.all of 100): each gets an answer, however many, so that no stub
    waits for one that will never come; the frame's size bounds the work."""
    calls, refused = [], []
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        ref = entry.get("ref")
        if not isinstance(ref, str) or not 0 < len(ref) <= _MAX_REF:
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            refused.append((ref, "malformed tool call"))
            continue
        arguments = entry.get("arguments")
        try:
            # What is announced to the client must be JSON: NaN and the
            # infinities Python writes are not, and a client's parser refuses them.
            json.dumps(arguments, allow_nan=False)
        except (TypeError, ValueError):
            refused.append((ref, "the arguments must be JSON (NaN and infinities are not)"))
            continue
        calls.append(ToolCall(ref, name, arguments))
    return calls, refused


@dataclass
class ToolExchange:
    """The tool traffic of one running call: outstanding answers, and the clock."""

    send: "callable"
    call_id: int
    handler: ToolHandler | None
    scope: asyncio.Timeout | None = None
    made: int = 0
    refused: int = 0
    dropped: int = 0
    _pending: set = field(default_factory=set)
    _tasks: set = field(default_factory=set)
    _remaining: float = 0.0

    def on_batch(self, raw: list) -> None:
        # Every entry costs the host work and, answered, a frame: the entries one
        # call gets looked at are bounded whatever their shape. One forged 4 MiB
        # frame of {"ref": …} entries held 200,000, each refused by a task of its
        # own outside the cap: four such frames took the server 2.3 GiB and its
        # event loop (every tenant's requests) for 35 s. The agent's stubs refuse
        # calls past the cap themselves, so what is dropped unanswered is forged.
        room = (max(MAX_CALLS_PER_CALL - self.made, 0)
                + max(MAX_REFUSALS_PER_CALL - self.refused, 0))
        if len(raw) > room:
            if not self.dropped:  # once per call: the flood itself must not flood the log
                log.warning("dropped tool call entries past the per-call bounds (forged?)")
            self.dropped += len(raw) - room
            raw = raw[:room]
        calls, refused = parse_calls(raw)
        refs = set(self._pending)
        fresh = []
        for call in calls:
            if call.ref not in refs:  # one answer per ref, even within a batch
                refs.add(call.ref)
                fresh.append(call)
        calls = fresh
        room = max(MAX_CALLS_PER_CALL - self.made, 0)
        refused += [(call.ref, f"at most {MAX_CALLS_PER_CALL} tool calls are allowed per call")
                    for call in calls[room:]]
        calls = calls[:room]
        refused = refused[:max(MAX_REFUSALS_PER_CALL - self.refused, 0)]
        if refused:
            self.refused += len(refused)
            self._track(asyncio.ensure_future(self._refuse(refused)))
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
            self._spawn(call.ref, outcome)

    async def _refuse(self, refused: list[tuple[str, str]]) -> None:
        """A batch's refusals, in order, from one task: a task each cost the host
        a coroutine per forged entry."""
        for ref, why in refused:
            try:
                await self.send({"op": "tool_result", "id": self.call_id, "ref": ref,
                                 "error": why})
            except Exception:  # noqa: BLE001 - the call ends on its own if the channel died
                return

    def _track(self, task: asyncio.Future) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self, ref: str, outcome: Awaitable[ToolOutcome]) -> None:
        if not self._pending:
            self._pause()
        self._pending.add(ref)
        self._track(asyncio.ensure_future(self._answer(ref, outcome)))

    async def _answer(self, ref: str, outcome: Awaitable[ToolOutcome]) -> None:
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
                try:
                    await self.send(message)
                except CallTooLarge:
                    # A result the channel cannot carry still answers the stub, at
                    # once, instead of leaving it to wait out its limit.
                    await self.send({"op": "tool_result", "id": self.call_id, "ref": ref,
                                     "error": "the tool's result is too large to hand to the "
                                              f"code (at most {MAX_RESULT_BYTES // MiB} MiB)"})
            except Exception:  # noqa: BLE001 - the call ends on its own if the channel died
                pass
        finally:
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
        try:
            self.scope.reschedule(asyncio.get_running_loop().time() + self._remaining)
        except RuntimeError:
            pass  # the call is over (cancelled while it waited): no clock to restart

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
