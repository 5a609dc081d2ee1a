"""Bounds on request bodies: each one, and all of those in progress together.

Routes read bodies whole (a JSON object is parsed from its last byte), so without
bounds one client could make the server hold any number of gigabytes, and many
clients at once could exhaust the host's memory for every tenant. Two bounds
hold before a route sees a byte:

- each body is at most ``Settings.request_cap`` (a file as large as the server
  accepts, base64-encoded in JSON, and a margin): a 413;
- the bodies of all requests in progress together hold at most
  ``request_buffer_mib``: a request whose next chunk would pass it is a 503
  with ``Retry-After``, and what it held is given back at once. Where tokens
  name several tenants, one tenant's bodies hold at most half of it (or one
  body at the cap, if more), so one tenant's stalled uploads cannot take every
  other tenant's room. The share is the tenant's, not the header's: spelt
  ``bearer`` or ``BEARER``, or with two spaces, a token still names one
  tenant (each spelling had a share of its own, and four took it all);
- a body that stops arriving for ``request_body_idle_seconds`` is a 408, and
  what it held is given back. A client that keeps sending, however slowly,
  keeps what it sent: within its tenant's share, which is what bounds it.

Both are raised from ``receive`` as ``HTTPException``s, so the route reading the
body answers in its own dialect (FastAPI's own ``max_body_size`` answers a
declared oversize in plain text, whatever the route). A declared
``Content-Length`` is refused before a byte is read; a chunked body is counted
as it arrives. Bytes stay counted until the response is sent, since that is as
long as a route may hold them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from starlette.exceptions import HTTPException

log = logging.getLogger("shoal")


_UNKNOWN = object()


class BodyTooLarge(HTTPException):
    def __init__(self, cap: int) -> None:
        super().__init__(413, f"the request body is larger than the server's {cap}-byte cap")


class BodiesBusy(HTTPException):
    def __init__(self) -> None:
        super().__init__(503, "the server holds as many request bodies as it may now; "
                              "retry in a moment")


class BodyStalled(HTTPException):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body stopped arriving for {seconds:g}s")


class Budget:
    """The bytes every request in progress has received, in all and by tenant;
    one per server. ``share`` is what one tenant's bodies may hold together."""

    def __init__(self, total: int, share: int | None = None) -> None:
        self.total = total
        self.share = min(share or total, total)
        self.used = 0
        self._held: dict[object, int] = {}

    def take(self, client: object, count: int) -> bool:
        mine = self._held.get(client, 0)
        if self.used + count > self.total or mine + count > self.share:
            return False
        self.used += count
        self._held[client] = mine + count
        return True

    def give(self, client: object, count: int) -> None:
        if not count:
            return
        self.used -= count
        left = self._held[client] - count
        if left:
            self._held[client] = left
        else:
            del self._held[client]


class BodyLimits:
    """ASGI middleware holding every request's body to ``cap`` and to ``budget``."""

    def __init__(self, app, cap: int, budget: Budget, idle_seconds: float = 30.0,
                 share_of: Callable[[dict], object] | None = None) -> None:
        self.app = app
        self.cap = cap
        self.budget = budget
        self.idle_seconds = idle_seconds
        # Whose share a request's body counts against (its tenant); without it,
        # all of them share one budget.
        self.share_of = share_of or (lambda scope: None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        client: object = _UNKNOWN  # looked up with the first chunk: most requests have none
        held = 0
        whole = False

        async def counted() -> dict:
            nonlocal client, held, whole
            if declared is not None and declared > self.cap:
                raise BodyTooLarge(self.cap)
            if whole:  # the body is in: what comes next is the client leaving
                return await receive()
            try:
                async with asyncio.timeout(self.idle_seconds):
                    message = await receive()
            except TimeoutError:
                raise BodyStalled(self.idle_seconds) from None
            if message["type"] == "http.request":
                if client is _UNKNOWN:
                    client = self.share_of(scope)
                size = len(message.get("body", b""))
                if held + size > self.cap:
                    raise BodyTooLarge(self.cap)
                if not self.budget.take(client, size):
                    log.warning("refused a request: the bodies in progress hold %d of %d "
                                "bytes", self.budget.used, self.budget.total,
                                extra={"resource": "request_buffer", "status": 503})
                    raise BodiesBusy()
                held += size
                whole = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.budget.give(client, held)


def _declared_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
