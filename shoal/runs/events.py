"""One event stream per run, with ids, that any number of readers can follow or replay.

A run does not belong to the connection that started it: its events are
appended here as they happen, and every reader (the SSE stream that started the
run, a client that reconnects with ``Last-Event-ID``, a gateway's tool loop)
reads from this log at its own pace. Ids rise by one from 1, so "after id N"
is exact; a log rebuilt from a stored record (shoal.runs.manager) keeps the ids
its events had and skips those it no longer holds.

Each event is kept as it goes on the wire, a server-sent event encoded once:
every reader sends the same bytes rather than a copy of its own, and what the
log holds is known to the byte (``size``). A log with a ``budget`` refuses a
``bounded`` event that would take it past that many bytes, and its writer
decides what that means (a run fails the tool call, drops the output event:
shoal.runs.manager); an event appended unbounded (a run's start and end, each
small or capped) always goes in. A closed log takes no more events.
"""

from __future__ import annotations

import asyncio
import json
from bisect import bisect_right
from dataclasses import dataclass
from operator import attrgetter
from typing import AsyncIterator

from sse_starlette import ServerSentEvent

# What an event costs beyond its bytes: the Event, its id and its slot in the
# list (measured with tracemalloc at some 130 bytes on CPython 3.11), so a flood
# of tiny events is held to the budget too.
EVENT_OVERHEAD = 160

_id_of = attrgetter("id")


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    name: str
    wire: bytes  # id:, event: and data: lines, the data the event's JSON


def encode(event_id: int, name: str, data: dict) -> bytes:
    return ServerSentEvent(json.dumps(data, ensure_ascii=False), event=name,
                           id=str(event_id)).encode()


class EventLog:
    def __init__(self, budget: int | None = None) -> None:
        self._events: list[Event] = []
        self._waiters: set[asyncio.Future] = set()
        self.closed = False
        self.budget = budget
        self.size = 0

    def append(self, name: str, data: dict, *, bounded: bool = False,
               event_id: int | None = None) -> Event | None:
        """The event appended; None if the log is closed or, ``bounded``, if it
        would take the log past its budget. ``event_id`` (past the last) skips
        ids, for a log rebuilt from a record."""
        if self.closed:
            return None
        last = self.last_id
        event_id = last + 1 if event_id is None else max(event_id, last + 1)
        wire = encode(event_id, name, data)
        cost = len(wire) + EVENT_OVERHEAD
        if bounded and self.budget is not None and self.size + cost > self.budget:
            return None
        event = Event(event_id, name, wire)
        self._events.append(event)
        self.size += cost
        self._notify()
        return event

    def close(self) -> None:
        """No more events: readers finish once they have read everything."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def last_id(self) -> int:
        return self._events[-1].id if self._events else 0

    def _position_after(self, event_id: int) -> int:
        if event_id <= 0:
            return 0
        return bisect_right(self._events, event_id, key=_id_of)

    def after(self, event_id: int) -> list[Event]:
        return self._events[self._position_after(event_id):]

    async def follow(self, after_id: int = 0) -> AsyncIterator[Event]:
        """Every event after ``after_id``, then each new one as it comes, until closed."""
        async for batch in self.follow_batches(after_id):
            for event in batch:
                yield event

    async def follow_batches(self, after_id: int = 0,
                             idle: float | None = None) -> AsyncIterator[list[Event]]:
        """The same events, each batch all that had arrived when the reader woke:
        a stream writes a batch at once (a short run's output, its end and the
        stream's end in one write, not one wake-up of the client each). With
        ``idle``, an empty batch after that many quiet seconds (a stream's ping)."""
        position = self._position_after(after_id)
        loop = asyncio.get_running_loop()
        while True:
            if position < len(self._events):
                batch = self._events[position:]
                position += len(batch)
                yield batch
                continue
            if self.closed:
                return
            waiter = loop.create_future()
            self._waiters.add(waiter)
            timer = loop.call_later(idle, _wake, waiter) if idle else None
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)
                if timer is not None:
                    timer.cancel()
            if position == len(self._events) and not self.closed:
                yield []
