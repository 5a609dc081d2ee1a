"""A streamed response that lets go of what it streams from, however it ends.

Starlette's ``StreamingResponse`` leaves its body iterator where it stopped when
the client hangs up or a send fails (a stalled client's response is cut,
shoal.api.stalled): the iterator's cleanup then waits for the garbage
collector, and a generator caught in a cycle with the exception's traceback
waits for a collection that a quiet server may not run for a long time. Until
then it held what it was streaming from: an upstream model's connection (one
of a pool every tenant shares) and the tenant's gateway slot, a file handle on
a session's volume (whose unmount then left its loop device attached), a
cluster host's connection. Every streamed response here is this one, and
closes its iterator as the response ends; the iterators close what they hold
in ``finally``.

A synchronous iterator is not closed by Starlette's thread-pool wrapper either:
stream from an async one (shoal.api._responses reads files that way).
"""

from __future__ import annotations

from typing import AsyncIterator

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class StreamingBody(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_iterator(self.body_iterator)


async def relayed(response: httpx.Response) -> AsyncIterator[bytes]:
    """An httpx response's body as it arrives (an upstream model's, a cluster
    host's), its connection closed however the relay ends."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


async def close_iterator(iterator: object) -> None:
    """``aclose()`` an async generator (a no-op once it is finished)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()
