"""Shutting down the way a load balancer expects.

uvicorn closes its listener the moment SIGTERM arrives. Clients then see
refused connections for as long as the balancer takes to notice, which is
seconds. This server does what Kubernetes and every balancer expect instead:

1. SIGTERM fails readiness (``/readyz`` answers 503) at once. The listener keeps
   serving, so requests still routed here succeed.
2. The drain ends once the server has kept serving for ``drain_seconds`` and no
   request is in flight, or once ``shutdown_grace_seconds`` have passed.
3. Calls still running when the grace period ends are cut. Each one returns
   what it had produced, with ``Retry-After``, instead of being dropped. Then
   the listener closes and the app shuts down: sandboxes stopped, volumes
   unmounted, nothing left running.

SIGINT (Ctrl-C in a terminal) skips the idle wait of step 2. A second signal
stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

import uvicorn

log = logging.getLogger("shoal.server")

# After calls are cut, how long their answers may take to leave.
CUT_ANSWER_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._app = app
        self._on_started = on_started
        self._announced = False
        self._drain_started: float | None = None
        self._idle_wait = True
        self._cut: asyncio.Task | None = None
        self._done = False

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started is None:
            self._captured_signals.append(sig)  # re-raised on exit, as uvicorn does
            self._drain_started = time.monotonic()
            self._idle_wait = sig != signal.SIGINT
            self._app.state.draining = True
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    async def on_tick(self, counter: int) -> bool:
        if not self._announced and self.started:
            self._announced = True
            self._on_started()
        if await super().on_tick(counter):
            return True
        if self._drain_started is None:
            return False
        if self._done:
            return True
        settings = self._app.state.settings
        elapsed = time.monotonic() - self._drain_started
        busy = bool(self.server_state.tasks)
        if elapsed >= settings.shutdown_grace_seconds:
            if self._cut is None:
                self._cut = asyncio.create_task(self._cut_calls())
            return self._cut.done()
        drained = not busy and (not self._idle_wait or elapsed >= settings.drain_seconds)
        if drained:
            self._done = True
        return drained

    async def _cut_calls(self) -> None:
        """The grace period is over: stop what still runs, so each call answers
        with what it produced, then give those answers a moment to leave."""
        self._app.state.cutting = True
        # A cluster front end holds no call of its own: its hosts run them.
        manager = getattr(self._app.state, "manager", None)
        cut = await manager.cut_all(
            "the server is shutting down: the call was stopped; retry it") if manager else 0
        if cut:
            log.warning("shutdown: cut %d calls still running at the end of the grace period",
                        cut)
        deadline = time.monotonic() + CUT_ANSWER_SECONDS
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
