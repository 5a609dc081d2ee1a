"""The host's end of the framed channel to one sandbox's agent.

Everything that arrives here was written by a process that untrusted code
shares (user Python runs inside the agent and can write to its socket), so every
frame is size-checked and every field type-checked before it is believed, and
output is never buffered past the cap whatever the agent claims.

One call runs at a time and its loop is the only reader; while it runs, the host
may still write to the agent (inner tool results, a cancellation) with
:meth:`Channel.send`.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from shoal.agent.protocol import HEADER, MAX_FRAME_BYTES, FrameError, decode, encode

OutputCallback = Callable[[str, str], None]
ToolCallsCallback = Callable[[list], None]


class ChannelClosed(Exception):
    """The agent's end went away: the sandbox process died or was killed."""


class ChannelCorrupt(ChannelClosed):
    """The agent sent something that is not a frame: the channel cannot be trusted
    to be in step any more, so it is treated as closed (the sandbox restarts)."""


class CallTooLarge(ValueError):
    """A call does not fit in one frame."""


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._next_id = 0
        self._send_lock = asyncio.Lock()

    @classmethod
    async def open(cls, sock: socket.socket) -> "Channel":
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME_BYTES)
        return cls(reader, writer)

    async def receive(self) -> dict:
        try:
            header = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"agent sent a frame of {size} bytes")
            return decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed(str(exc) or "channel closed") from None
        except FrameError as exc:
            raise ChannelCorrupt(str(exc)) from None

    def next_call_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def send(self, message: dict) -> None:
        try:
            frame = encode(message)
        except FrameError as exc:
            raise CallTooLarge(str(exc)) from None
        async with self._send_lock:
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (ConnectionError, RuntimeError) as exc:
                raise ChannelClosed(str(exc)) from None

    async def call(self, message: dict, on_output: OutputCallback,
                   on_tool_calls: ToolCallsCallback | None = None,
                   call_id: int | None = None) -> dict:
        """Send one call and collect frames until its ``done``: output goes to
        ``on_output``, the calls of inner tool stubs to ``on_tool_calls``."""
        call_id = call_id if call_id is not None else self.next_call_id()
        await self.send({**message, "id": call_id})
        while True:
            frame = await self.receive()
            if frame.get("id") != call_id:
                continue  # a stale or forged frame: not an answer to this call
            kind = frame.get("type")
            if kind == "out":
                stream, data = frame.get("stream"), frame.get("data")
                if stream in ("stdout", "stderr") and isinstance(data, str):
                    on_output(stream, data)
            elif kind == "tool_calls":
                calls = frame.get("calls")
                if on_tool_calls is not None and isinstance(calls, list):
                    on_tool_calls(calls)
            elif kind == "done":
                return frame

    def close(self) -> None:
        try:
            self._writer.close()
        except RuntimeError:
            pass  # the loop is already closed
