"""Multipart uploads that are refused as soon as they pass the cap.

A declared ``Content-Length`` over the cap is refused before a byte of the
body is read; a chunked body is counted as it arrives and abandoned the moment
it passes the cap, so an oversized upload is never buffered whole.
"""

from __future__ import annotations

from fastapi import Request
from starlette.datastructures import UploadFile

from .errors import BadRequest

# Room for the multipart framing and small fields around the file itself.
_MULTIPART_OVERHEAD = 64 * 1024


class _BodyTooLarge(Exception):
    pass


def upload_file_name(filename: str | None) -> str:
    """The base name of an uploaded file, or a 422 for a name no file should have."""
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    if name in ("", ".", ".."):
        raise BadRequest(422, "the 'file' part needs a file name (or give a 'path')")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        raise BadRequest(422, "a file name must not contain NUL or control characters")
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise BadRequest(422, "a file name must be at most 255 bytes")
    return name


def _limited(request: Request, limit: int) -> Request:
    received = 0
    receive = request.receive

    async def counting_receive():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise _BodyTooLarge()
        return message

    return Request(request.scope, counting_receive)


async def read_upload(request: Request, max_file_bytes: int,
                      too_large: int = 413) -> tuple[UploadFile, dict[str, str]]:
    """The uploaded ``file`` part and the form's text fields. ``too_large`` is the
    status of an upload over the cap: 413, but 400 in Caronte's (OpenAI's) dialect,
    whose limits table promises a 400 before the body is buffered."""
    limit = max_file_bytes + _MULTIPART_OVERHEAD
    message = f"upload is larger than the {max_file_bytes}-byte cap"
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(too_large, message, param="file")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest(422, "expected a multipart/form-data body with a 'file' part")
    try:
        form = await _limited(request, limit).form(max_files=1, max_fields=16)
    except _BodyTooLarge:
        raise BadRequest(too_large, message, param="file") from None
    except Exception as exc:  # malformed multipart of any kind is the client's error
        status = getattr(exc, "status_code", 422)
        raise BadRequest(422 if status >= 500 else status,
                         f"malformed multipart body: {getattr(exc, 'detail', exc)}") from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise BadRequest(422, "the multipart body needs a 'file' part holding the file")
    if upload.size is not None and upload.size > max_file_bytes:
        await upload.close()
        raise BadRequest(too_large, message, param="file")
    fields = {key: value for key, value in form.items() if isinstance(value, str)}
    return upload, fields
