"""The tool loop, dialect-neutral: ask the model, run its code calls, feed the results back.

For the upstream model the gateway's server tools are ordinary function tools;
each time the model calls one, the engine runs it in the request's container
(through the runs layer, like every execution) and continues, until the model
stops, calls a tool the client owns, or the request's budget of sandbox round
trips is spent. What the client sees, and in which shape, is the dialect's
business: an :class:`Adapter` per dialect maps requests, histories and results;
the engine only drives.

The loop is an async generator of the events the client is sent, so a
streaming client gets each as it happens, a non-streaming one gets them
assembled, and a client that goes away cancels the generator: the upstream
call is dropped and the run in flight is cancelled, so nothing is left running.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from shoal.egress.tokens import ModelAccess
from shoal.runs import Run, RunManager, RunRequest

from .upstream import Timing

log = logging.getLogger("shoal.gateway")

# While the sandbox works, or the model thinks in a later turn, a streaming
# client still hears from us this often (the server's stream_ping_seconds).
KEEPALIVE_SECONDS = 15.0
_END = object()
# What the model is told of one output stream, in characters. The client gets the
# whole output (up to the sandbox's cap, 1 MiB); a model sent a megabyte of log
# is sent more than its context holds, and the upstream refuses the next turn,
# and every later request of a client that keeps the result in its history.
MODEL_OUTPUT_CHARS = 40_000


def for_model(text: str, limit: int = MODEL_OUTPUT_CHARS) -> str:
    """``text`` as the model is told it: its head and tail past ``limit``."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return (f"{text[:head]}\n[... {len(text) - head - tail} characters omitted: the output "
            f"was too long to show in full ...]\n{text[len(text) - tail:]}")


@dataclass
class ToolUse:
    """A call the model made to a function tool."""

    id: str
    name: str
    arguments: object


@dataclass
class Turn:
    """One upstream call's outcome: its tool uses, why it stopped, what it cost."""

    tool_uses: list[ToolUse] = field(default_factory=list)
    stop_reason: str | None = None
    usage: dict = field(default_factory=dict)
    # The model was cut off (its output limit): its calls may be half-written,
    # and the response ends here, with its stop reason, without running them.
    truncated: bool = False


@dataclass
class Paused:
    """The code of a run waits for client tools: the response ends with those calls."""

    run: Run
    use: ToolUse


class Adapter(Protocol):
    """What a dialect supplies to the engine."""

    #: Where the request's time goes; the adapter adds its upstream waits.
    timing: Timing

    def upstream_turn(self) -> AsyncIterator[object]:
        """Call the model once; yields client events as they come, and finally a Turn."""

    def is_code_tool(self, name: str) -> bool: ...

    async def run_request(self, use: ToolUse) -> RunRequest | object:
        """The run a code tool call asks for, or a failure the call answers with instead."""

    async def tool_result(self, use: ToolUse, run: Run | None, failure: object) -> list[object]:
        """Client events for a finished call, after recording its result for the model."""

    def refusal(self, reason: str) -> object:
        """A failure, in the dialect's terms, for a call the loop will not run."""

    def paused(self, pause: Paused) -> list[object]:
        """Client events for a call whose code waits on client tools (Caronte's)."""

    def finish(self, stop_reason: str) -> list[object]:
        """The closing client events."""

    def keepalive(self) -> object | None: ...


class ToolLoop:
    def __init__(self, adapter: Adapter, runs: RunManager, tenant: str,
                 max_round_trips: int, model: ModelAccess | None = None,
                 max_calls: int | None = None,
                 keepalive_seconds: float = KEEPALIVE_SECONDS) -> None:
        # The request's model API, for the code it runs (shoal.egress.tokens).
        self.model = model
        self.adapter = adapter
        self.runs = runs
        self.tenant = tenant
        self.max_round_trips = max_round_trips
        # The client's own bound on the calls run (OpenAI's max_tool_calls): past
        # it a call is answered, not run, and the model goes on to its answer.
        self.max_calls = max_round_trips if max_calls is None else min(max_calls, max_round_trips)
        self.keepalive_seconds = keepalive_seconds
        self.round_trips = 0
        self.executions = 0
        self.paused: Paused | None = None
        self._active: Run | None = None
        self.timing = adapter.timing

    async def events(self, resume: Paused | None = None) -> AsyncIterator[object]:
        """Every client event of this request, in order. ``resume`` continues a
        run paused by an earlier request (its client tools were just answered)."""
        adapter = self.adapter
        try:
            if resume is not None:
                async for event in self._wait(resume.run, resume.use):
                    yield event
                if self.paused is not None:
                    return
                self.round_trips += 1
            while True:
                turn = None
                # The first turn says nothing until the upstream answers: its
                # refusal (a 429, a 529) is still the response's status. A later
                # one waits on a model that may think for minutes, in a stream
                # that has begun: a proxy cuts one silent for its read timeout.
                turns = adapter.upstream_turn()
                if (self.round_trips or resume is not None) and adapter.keepalive() is not None:
                    turns = self._kept_alive(turns)
                async for item in turns:
                    if isinstance(item, Turn):
                        turn = item
                    else:
                        yield item
                assert turn is not None, "an upstream turn ends with its Turn"
                ours = [use for use in turn.tool_uses if adapter.is_code_tool(use.name)]
                if not ours or turn.truncated:
                    # Asked again, a model cut off at its limit is cut off again:
                    # each retry was a paid call, up to the round-trip budget.
                    for event in adapter.finish(turn.stop_reason or "end_turn"):
                        yield event
                    return
                for use in ours:
                    if self.executions >= self.max_calls:
                        # One turn may ask for many calls: the budget is of
                        # executions, each up to its timeout, not of turns. The
                        # rest are answered, not run; the client may continue.
                        refused = adapter.refusal(
                            f"this request ran {self.executions} code executions, its limit; "
                            "this call was not run (continue in a new request)")
                        for event in await adapter.tool_result(use, None, refused):
                            yield event
                        continue
                    async for event in self._call(use):
                        yield event
                    if self.paused is not None:
                        return
                if len(ours) < len(turn.tool_uses):
                    for event in adapter.finish("tool_use"):
                        yield event
                    return
                self.round_trips += 1
                if (self.round_trips >= self.max_round_trips
                        or self.executions >= self.max_round_trips):
                    for event in adapter.finish("pause_turn"):
                        yield event
                    return
        finally:
            if self._active is not None and self.paused is None and not self._active.finished.is_set():
                # The client went away mid-call: the run must not outlive the request.
                await asyncio.shield(self._cancel(self._active))

    async def _kept_alive(self, items: AsyncIterator[object]) -> AsyncIterator[object]:
        """``items``, with a keep-alive each ``keepalive_seconds`` none comes. The
        upstream turn runs whole in a task of its own (its HTTP stream is opened
        and closed there), handing its items over a queue."""
        handed: asyncio.Queue = asyncio.Queue(maxsize=64)

        async def produce() -> None:
            try:
                async for item in items:
                    await handed.put((item, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - raised again where it is read
                await handed.put((_END, exc))
                return
            await handed.put((_END, None))

        producer = asyncio.ensure_future(produce())
        getter: asyncio.Future | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(handed.get())
                done, _ = await asyncio.wait([getter], timeout=self.keepalive_seconds)
                if not done:
                    ping = self.adapter.keepalive()
                    if ping is not None:
                        yield ping
                    continue
                item, error = getter.result()
                getter = None
                if item is _END:
                    if error is not None:
                        raise error
                    return
                yield item
        finally:
            for task in (getter, producer):
                if task is not None and not task.done():
                    task.cancel()
            # The upstream call is dropped before the loop goes on (or away).
            await asyncio.gather(producer, return_exceptions=True)

    async def _cancel(self, run: Run) -> None:
        try:
            await self.runs.cancel(self.tenant, run.id)
        except Exception:  # noqa: BLE001 - it finished meanwhile
            pass

    async def _call(self, use: ToolUse) -> AsyncIterator[object]:
        request = await self.adapter.run_request(use)
        if not isinstance(request, RunRequest):
            for event in await self.adapter.tool_result(use, None, request):
                yield event  # refused before running: the adapter's own failure
            return
        self.executions += 1
        if self.model is not None:
            request.model = self.model
        run = await self.runs.start(self.tenant, request)
        async for event in self._wait(run, use):
            yield event

    async def _wait(self, run: Run, use: ToolUse) -> AsyncIterator[object]:
        """Until the run finishes or pauses on client tools, with keep-alives."""
        self._active = run
        settled = asyncio.ensure_future(_until_settled(run))
        try:
            while True:
                done, _ = await asyncio.wait([settled], timeout=self.keepalive_seconds)
                if done:
                    break
                ping = self.adapter.keepalive()
                if ping is not None:
                    yield ping
        finally:
            if not settled.done():
                settled.cancel()
        if settled.result():
            self.paused = Paused(run, use)
            for event in self.adapter.paused(self.paused):
                yield event
            return
        self._active = None
        if run.result is not None:
            self.timing.sandbox += run.result.execution_time_ms / 1000
        self.timing.round_trips += 1
        for event in await self.adapter.tool_result(use, run, None):
            yield event


async def _until_settled(run: Run) -> bool:
    """True when the run waits for client tools, False once it finished."""
    if run.finished.is_set():
        return False
    async for event in run.log.follow(0):
        if event.name == "tool_call.required" and run.waiting:
            return True
        if event.name in ("run.completed", "run.failed"):
            return False
    return False
