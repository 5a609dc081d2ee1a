"""Responses a client stops taking: cut after ``response_stall_seconds``.

uvicorn's flow control makes a send wait while the connection's buffer is past
its high-water mark, and a client that stays connected but reads nothing keeps
it there for ever. The route that sends waits with it, holding what it streams
from: a run's event log (up to ``run_log_bytes``, outside the finished logs'
budget once it was evicted from it), a gateway turn with its upstream model
connection (one of ``upstream_max_connections``, shared by every tenant), an
open file. A tenant could pin any number of them by opening streams it never
reads. So, as nginx's ``send_timeout`` does, a send that has not gone out after
``response_stall_seconds`` ends the response: the route's send raises
``ResponseStalled``, its stream unwinds and lets go of what it held, and
uvicorn closes the connection. The clock runs per send, so a slow reader that
keeps taking data is never cut, however long its response.

A timeout around every send cost 8 µs each (a timer per send, two sends per
``/health``); the sends in progress are kept in one dict instead, and a single
timer, armed only while some are, sweeps them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

log = logging.getLogger("shoal")

# Set in the request's task once its response was cut: uvicorn then reports
# "ASGI callable returned without completing response" as an error, which for
# a cut response is the expected end, already logged here as a warning.
_cut_here: contextvars.ContextVar[bool] = contextvars.ContextVar("shoal_response_cut",
                                                                 default=False)
_UNCOMPLETED = "ASGI callable returned without completing response."


class ResponseCut(Exception):
    """Raised from a response that has begun, to end it broken: its connection is
    closed, so its client sees it incomplete rather than whole. Whoever raises
    it logs why."""


class ResponseStalled(ResponseCut):
    """The client took no part of a send for the allowed time."""


def _not_a_cut(record: logging.LogRecord) -> bool:
    return not (record.msg == _UNCOMPLETED and _cut_here.get())


class StalledResponses:
    """ASGI middleware ending every response whose client stops reading."""

    def __init__(self, app, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self._tick = min(1.0, seconds / 4)
        self._sending: dict[asyncio.Task, float] = {}  # a task in a send: since when
        self._cut: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        uvicorn_log = logging.getLogger("uvicorn.error")
        if _not_a_cut not in uvicorn_log.filters:
            uvicorn_log.addFilter(_not_a_cut)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        sending, cut = self._sending, self._cut

        async def watched(message) -> None:
            task = asyncio.current_task()
            assert task is not None
            cancelling = task.cancelling()
            sending[task] = loop.time()
            if self._timer is None:
                self._timer = loop.call_later(self._tick, self._sweep, loop)
            try:
                await send(message)
            except asyncio.CancelledError:
                if task in cut:
                    cut.discard(task)
                    if task.uncancel() <= cancelling:
                        raise ResponseStalled from None
                raise
            finally:
                del sending[task]
                cut.discard(task)

        try:
            await self.app(scope, receive, watched)
        except* ResponseStalled:
            # A group too: a StreamingResponse sends from a task group's child.
            _cut_here.set(True)
            log.warning("cut a response: its client took none of it for %gs", self.seconds,
                        extra={"method": scope.get("method"), "path": scope.get("path")})
        except* ResponseCut:
            _cut_here.set(True)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        deadline = loop.time() - self.seconds
        for task, since in list(self._sending.items()):
            if since <= deadline and task not in self._cut:
                self._cut.add(task)
                task.cancel()
        if self._sending:
            self._timer = loop.call_later(self._tick, self._sweep, loop)
