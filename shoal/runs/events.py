"""One event stream per run, with ids, that any number of readers can follow or replay.

A run does not belong to the connection that started it: its events are
appended here as they happen, and every reader (the SSE stream that started the
run, a client that reconnects with ``Last-Event-ID``, a gateway's tool loop)
reads from this log at its own pace. Ids are the event's position, so "after
id N" is exact. The log is bounded by what it holds: output events carry at
most the run's output caps, and a closed log takes no more events.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True)
class Event:
    id: int
    name: str
    data: dict


class EventLog:
    def __init__(self) -> None:
        self._events: list[Event] = []
        self._waiters: set[asyncio.Future] = set()
        self.closed = False

    def append(self, name: str, data: dict) -> Event | None:
        if self.closed:
            return None
        event = Event(len(self._events) + 1, name, data)
        self._events.append(event)
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
        return len(self._events)

    def after(self, event_id: int) -> list[Event]:
        return self._events[max(0, event_id):]

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
        position = max(0, after_id)
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
