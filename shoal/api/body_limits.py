"""Bounds on request bodies: each one, and all of those in progress together.

Routes read bodies whole (a JSON object is parsed from its last byte), so without
bounds one client could make the server hold any number of gigabytes, and many
clients at once could exhaust the host's memory for every tenant. Two bounds
hold before a route sees a byte:

- each body is at most ``Settings.request_cap`` (a file as large as the server
  accepts, base64-encoded in JSON, and a margin): a 413;
- the bodies of all requests in progress together hold at most
  ``request_buffer_mib``: a request whose next chunk would pass it is a 503
  with ``Retry-After``, and what it held is given back at once.

Both are raised from ``receive`` as ``HTTPException``s, so the route reading the
body answers in its own dialect (FastAPI's own ``max_body_size`` answers a
declared oversize in plain text, whatever the route). A declared
``Content-Length`` is refused before a byte is read; a chunked body is counted
as it arrives. Bytes stay counted until the response is sent, since that is as
long as a route may hold them.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException

log = logging.getLogger("shoal")


class BodyTooLarge(HTTPException):
    def __init__(self, cap: int) -> None:
        super().__init__(413, f"the request body is larger than the server's {cap}-byte cap")


class BodiesBusy(HTTPException):
    def __init__(self) -> None:
        super().__init__(503, "the server holds as many request bodies as it may now; "
                              "retry in a moment")


class Budget:
    """The bytes every request in progress has received; one per server."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def take(self, count: int) -> bool:
        if self.used + count > self.total:
            return False
        self.used += count
        return True

    def give(self, count: int) -> None:
        self.used -= count


class BodyLimits:
    """ASGI middleware holding every request's body to ``cap`` and to ``budget``."""

    def __init__(self, app, cap: int, budget: Budget) -> None:
        self.app = app
        self.cap = cap
        self.budget = budget

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        held = 0

        async def counted() -> dict:
            nonlocal held
            if declared is not None and declared > self.cap:
                raise BodyTooLarge(self.cap)
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                if held + size > self.cap:
                    raise BodyTooLarge(self.cap)
                if not self.budget.take(size):
                    log.warning("refused a request: the bodies in progress hold %d of %d "
                                "bytes", self.budget.used, self.budget.total,
                                extra={"resource": "request_buffer", "status": 503})
                    raise BodiesBusy()
                held += size
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.budget.give(held)


def _declared_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
