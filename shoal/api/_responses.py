"""Response helpers shared by the dialects: JSON without the encoder's detour,
and file bodies that stream when large and close their handle either way."""

from __future__ import annotations

import json
from typing import BinaryIO
from urllib.parse import quote

from fastapi import Response
from starlette.concurrency import run_in_threadpool

from shoal.streaming import StreamingBody

_SMALL_FILE_BYTES = 1024 * 1024
_CHUNK = 1 << 20
# What code and clients wrote is served from the API's own origin, inline when
# asked: a browser must take it as the type it is named (no sniffing an image
# into HTML), and HTML opened from it runs in a sandbox (an opaque origin, no
# script), never as a page of the API.
FILE_HEADERS = {"x-content-type-options": "nosniff",
                "content-security-policy": "sandbox; default-src 'none'; img-src data:; "
                                           "style-src 'unsafe-inline'"}


def json_response(payload: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status_code=status,
                    media_type="application/json", headers=headers)


def header_safe(text: str) -> str:
    """Printable ASCII only: file names are chosen by code and clients, and a CR,
    LF or other control character in a header would break the response."""
    return "".join(char if 0x20 <= ord(char) < 0x7F else "_" for char in text)


def content_disposition(name: str, inline: bool = False) -> str:
    kind = "inline" if inline else "attachment"
    plain = header_safe(name).replace('"', "_").replace("\\", "_")
    return f"{kind}; filename=\"{plain}\"; filename*=utf-8''{quote(name, safe='')}"


async def file_response(handle: BinaryIO, size: int, name: str, media_type: str,
                        inline: bool = False) -> Response:
    """The file's first ``size`` bytes (its size when opened, which the cap was
    checked against): code may go on writing to a file being downloaded, and a
    read to its end served past the cap, or past the declared Content-Length,
    which cut the download off."""
    headers = {"content-disposition": content_disposition(name, inline), **FILE_HEADERS}
    if size <= _SMALL_FILE_BYTES:
        with handle:
            data = await run_in_threadpool(handle.read, size)
        return Response(data, media_type=media_type, headers=headers)

    async def chunks():
        # Async, and closed by StreamingBody: a client that leaves mid-download
        # lets go of the handle at once, not at the next garbage collection.
        left = size
        try:
            while left > 0 and (chunk := await run_in_threadpool(handle.read,
                                                                 min(_CHUNK, left))):
                left -= len(chunk)
                yield chunk
        finally:
            handle.close()

    headers["content-length"] = str(size)
    return StreamingBody(chunks(), media_type=media_type, headers=headers)
