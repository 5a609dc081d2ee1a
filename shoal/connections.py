"""What a client's connections may hold: headers within ``request_header_seconds``,
and no more than ``max_connections`` open.

uvicorn arms its keep-alive timer only once a response is complete, and cancels
it on any byte received. A connection that sends nothing, or part of a request's
headers and then nothing, is therefore held for ever, and so is a kept-alive one
that sends a byte of its next request (even a bare CRLF, which the parser skips)
and stops. Each holds one of the server's file descriptors, and no token is
needed to open one: a few hundred left the server unable to accept requests or
start sandboxes ("Too many open files").

So, as nginx's ``client_header_timeout`` does, a connection has
``request_header_seconds`` to complete a request's headers: from when it is
made, and on a kept-alive connection from the first byte after its response
(until then it is idle, and uvicorn's keep-alive timer closes it after
``keep_alive_seconds``, unchanged). Past the deadline the connection is closed;
one that had begun a request gets a 408 first, so a slow client learns why.
Bodies have their own clock (``request_body_idle_seconds``, shoal.api.body_limits).

The deadline alone bounds how long each such connection lasts, not how many
there are. uvicorn's ``limit_concurrency`` (``max_connections``) answers a
request 503 once the open connections, its own among them, reach it, but it
accepts connections without limit and judges them only when their headers are
complete. So a connection accepted past the cap is closed at once: clients hold
at most ``max_connections`` of the server's fds, whatever they send, and the
rest stay its sandboxes'.

The protocol is uvicorn's httptools one with one timer per connection, armed at
most once per request, the same cost as uvicorn's own keep-alive timer.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from shoal.api.errors import error_response

log = logging.getLogger("shoal.server")

_TIMED_OUT = b"request headers took too long"
# Connections refused past the cap are said at most this often: a flood of
# them would otherwise be a flood of log lines.
_REFUSAL_LOG_SECONDS = 60.0


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request's headers
    do not arrive within ``header_seconds``, and one made past the cap."""

    header_seconds: float = 30.0
    _refusal_logged: float | None = None  # class-wide: when a refusal was last said

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_begun = False  # some of a request's head arrived, not all of it

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            self._refuse()
            return
        self._arm_header_deadline()

    def _refuse(self) -> None:
        now = self.loop.time()
        last = type(self)._refusal_logged
        if last is None or now - last >= _REFUSAL_LOG_SECONDS:
            type(self)._refusal_logged = now
            log.warning("refusing connections: %d are open, max_connections is %d",
                        len(self.connections) - 1, self.limit_concurrency)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        # The first bytes after a response start the next request's clock here,
        # not in on_message_begin alone: the parser skips CRLFs between requests
        # without beginning one, and uvicorn has cancelled its keep-alive timer.
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_deadline()
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._request_begun = True
        # A request pipelined behind one still being answered begins here.
        if self._header_timer is None:
            self._arm_header_deadline()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._request_begun = False
        self._cancel_header_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle, app) -> None:
        # uvicorn's own 503 past limit_concurrency is plain text without
        # Retry-After; a client's SDK parses the route's dialect and retries on it.
        if app is service_unavailable:
            app = _at_capacity
        super()._start_asgi_task(cycle, app)

    def _arm_header_deadline(self) -> None:
        self._header_timer = self.loop.call_later(self.header_seconds, self._headers_overdue)

    def _cancel_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The server still owes a response (to the request pipelined ahead of
            # this one): the wait is not the client's; its clock starts again.
            self._arm_header_deadline()
            return
        if self._request_begun:
            log.info("closed a connection from %s: its request's headers took more than %gs",
                     self.client[0] if self.client else "?", self.header_seconds)
            head = [STATUS_LINE[408]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [b"content-type: text/plain; charset=utf-8\r\n",
                     b"content-length: %d\r\n" % len(_TIMED_OUT),
                     b"connection: close\r\n\r\n", _TIMED_OUT]
            self.transport.write(b"".join(head))
        # One that sent nothing of a request is closed as an idle one is: silently.
        self.transport.close()


async def _at_capacity(scope, receive, send) -> None:
    response = error_response(Request(scope), 503, "the server holds as many connections as it "
                              "may; retry in a moment", headers={"Connection": "close"})
    await response(scope, receive, send)


def header_deadline_protocol(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``http=``, with this deadline (uvicorn
    makes each connection's protocol from the class and its own config)."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_seconds": seconds})
