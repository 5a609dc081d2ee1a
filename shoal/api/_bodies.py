"""Reading JSON request bodies the same strict way in every dialect.

Anything that is not a JSON object a client could mean is a 422 with a reason:
invalid JSON, nesting deep enough to exhaust the parser, or strings holding
lone surrogates (valid JSON escapes, but not text: they could never be written
to a file or echoed back).
"""

from __future__ import annotations

import json

from fastapi import Request

from shoal.runs import manager

from .errors import BadRequest

# A container's name: OpenAI documents no cap, but every listing carries each
# name, so one must exist (a 1 MB name rode along on every GET /v1/containers).
MAX_CONTAINER_NAME_CHARS = 256


def distinct_file_ids(file_ids: list[str], param: str = "file_ids") -> list[str]:
    """The ids in their order, each once, or a 400 past ``MAX_FILE_IDS`` of them."""
    try:
        return manager.distinct_file_ids(file_ids)
    except manager.TooManyFiles as exc:
        raise BadRequest(400, f"{param} {exc}", param=param) from None


class _Twice(ValueError):
    pass


def _once_each(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Twice(key)
        seen[key] = value
    return seen


def key_named_twice(raw: bytes) -> str | None:
    """A key an object of the (valid) JSON ``raw`` names twice, or None. Parsers
    differ on which of the two counts: a body checked here as one thing may be
    read by the server it is passed on to as another."""
    try:
        json.loads(raw, object_pairs_hook=_once_each)
    except _Twice as twice:
        return str(twice)
    return None


async def read_json_object(request: Request, required: bool = True) -> dict:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise BadRequest(422, "a JSON object body is required")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(422, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(422, "body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(422, "body must be a JSON object")
    # A lone surrogate can only come from a \uD800-\uDFFF escape: look closer only
    # when the raw text has one (most bodies do not, and the check re-encodes it all).
    if b"\\ud" in raw or b"\\uD" in raw:
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(422, "body holds a string that is not valid Unicode "
                                  "(a lone surrogate escape)") from None
    return body
