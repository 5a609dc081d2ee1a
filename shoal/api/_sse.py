"""Server-sent events: one coroutine per stream.

What Shoal streams are event logs (shoal.runs.events): a run's events, a
streaming exec's output. sse-starlette's response runs four tasks under a task
group for every stream (the writer, a ping timer, a shutdown listener, a
disconnect listener) and a cancel scope around every write; on a short run that
machinery was some 0.6 ms of a 4 ms request on a two-core machine, more than
the run's own code took in its sandbox (``bench/runs_bench.py``). This response
writes from the task the request already has: each chunk its source yields,
and a comment when the source yields an empty one (a quiet log, so that proxies
keep the connection). A stream that lasts gets one small task that waits for
the client to leave and stops the stream then; a log always ends on its own,
when its run does (the drain ends runs by cutting their calls). The wire format
stays sse-starlette's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from shoal.runs.events import Event
from shoal.streaming import close_iterator

PING = b": ping\r\n\r\n"
CHUNK_BYTES = 64 * 1024
# A stream this young has no watcher for its client's leaving: most streams (a
# short run's) end before it, on their own, and a task per stream cost them a
# tenth of their time. Past it, a stream whose client left ends at once.
_WATCH_AFTER_SECONDS = 1.0


def chunks(batch: list[Event]) -> Iterator[bytes]:
    """A batch of a log's events in writes of at most CHUNK_BYTES (a larger event
    in slices of it). A whole backlog in one write was a copy of it per reader,
    held until the client took it all (never, for one that does not read); a
    send waits while the connection's buffer is past its high-water mark
    (uvicorn's flow control), so a reader now holds one chunk, and the events
    themselves stay the log's, shared. A short run's batch is one write."""
    pending: list[bytes] = []
    size = 0
    for event in batch:
        wire = event.wire
        if pending and size + len(wire) > CHUNK_BYTES:
            yield b"".join(pending)
            pending, size = [], 0
        if len(wire) > CHUNK_BYTES:
            view = memoryview(wire)
            for start in range(0, len(wire), CHUNK_BYTES):
                yield bytes(view[start:start + CHUNK_BYTES])
            continue
        pending.append(wire)
        size += len(wire)
    if pending:
        yield b"".join(pending)


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        streaming = asyncio.current_task()
        assert streaming is not None
        loop = asyncio.get_running_loop()
        watcher: asyncio.Task | None = None

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            streaming.cancel()

        def watch() -> None:
            nonlocal watcher
            watcher = loop.create_task(client_left())

        timer = loop.call_later(_WATCH_AFTER_SECONDS, watch)
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk or PING,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if watcher is None or not watcher.done() or watcher.cancelled():
                raise  # not the client's leaving: the server's own cancellation
            streaming.uncancel()
            return
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            await close_iterator(self.chunks)
