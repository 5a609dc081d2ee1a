"""The framed channel protocol spoken between the host and the agent.

Both sides import this module (the agent inside the sandbox, the host's channel
layer outside), so it must stay standard-library only. A frame is a 4-byte
big-endian length followed by that many bytes of UTF-8 JSON. The channel is a
socket the host hands the agent as an inherited fd; it is never the program's
own stdin or stdout, so nothing user code prints can forge a frame.

Host to agent: ``{"id": int, "op": str, ...}``; ``op`` is ``python``, ``bash``,
``edit``, ``javascript``, ``ping`` or ``interrupt``.
Agent to host: ``{"id": int, "type": "out", "stream": "stdout"|"stderr",
"data": str}`` while a call runs, then one ``{"id": int, "type": "done", ...}``.
"""

from __future__ import annotations

import json
import socket
import struct

CHANNEL_FD = 3
HEADER = struct.Struct(">I")
# A frame carries at most one output chunk or one result; anything bigger is a
# broken or hostile peer, and reading it whole would let it exhaust our memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024


class FrameError(Exception):
    """The peer sent something that is not a valid frame."""


def encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    except RecursionError:
        raise FrameError("frame is nested too deeply") from None
    if not isinstance(message, dict):
        raise FrameError("frame is not a JSON object")
    return message


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = []
    remaining = size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict | None:
    """Read one frame, blocking; ``None`` when the peer closed the channel."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    body = _recv_exactly(sock, size)
    if body is None:
        return None
    return decode(body)
