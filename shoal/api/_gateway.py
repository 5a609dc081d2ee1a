"""What the two gateway routers share about a request's lifetime.

A gateway request may hold a model connection, and a sandbox, for minutes. It
is counted against its tenant's share while it does (``Gateway.hold``), and it
ends when its client leaves: a non-streaming request, or a streaming one that
has not sent its first event, waits inside the handler, where Starlette does
not notice a hang-up, so these helpers watch for it there and stop the work
(the tool loop's own cleanup cancels the run in flight). A streaming response
that has begun is Starlette's to stop (shoal.streaming closes its body then);
it gives the tenant's slot back when its body ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from shoal.streaming import close_iterator

T = TypeVar("T")


async def held(gateway, tenant: str, serve: Callable[[], Awaitable[Response]]) -> Response:
    """``serve()``'s response, counted against ``tenant``'s share of the gateway
    (``Gateway.hold``: a 429 past it) until its body has been sent."""
    release = gateway.hold(tenant)
    try:
        return _releasing(await serve(), release)
    except BaseException:
        release()
        raise


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientDisconnect (and ``work`` cancelled) if the
    client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not gone.done():
            gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task  # its cleanup (the loop cancels its run) finishes before we answer
    raise ClientDisconnect()


async def _hung_up(request: Request) -> None:
    # The body is read by now: what the server sends next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def drain(events: AsyncIterator[object]) -> None:
    async for _ in events:
        pass


async def first_chunk(iterator: AsyncIterator[bytes | None]) -> bytes | None:
    """The loop's first event to send (it yields None for a turn with nothing to
    show yet), or None if it ended without one."""
    while True:
        try:
            chunk = await iterator.__anext__()
        except StopAsyncIteration:
            return None
        if chunk is not None:
            return chunk


async def streamed(first: bytes | None, iterator: AsyncIterator[bytes | None],
                   failure: Callable[[Exception], Iterable[bytes]]) -> AsyncIterator[bytes]:
    """A streaming response's body: ``first`` (None: the loop ended without an
    event), then the loop's events. Past the first event the status is sent, so
    a failure ends the stream with the dialect's own events (``failure(exc)``).
    The loop's iterator is closed however this ends: its cleanup cancels its
    run and closes its model connection."""
    try:
        if first is None:
            return
        yield first
        try:
            async for chunk in iterator:
                if chunk is not None:
                    yield chunk
        except Exception as exc:  # noqa: BLE001 - the stream says so instead of breaking off
            for event in failure(exc):
                yield event
    finally:
        await close_iterator(iterator)


def _releasing(response: Response, release: Callable[[], None]) -> Response:
    """``response``, with ``release`` called once its body has been sent (or
    abandoned); at once for a response whose body is already whole."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _then(response.body_iterator, release)
    else:
        release()
    return response


async def _then(chunks: AsyncIterator, release: Callable[[], None]) -> AsyncIterator:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        try:
            await close_iterator(chunks)
        finally:
            release()
