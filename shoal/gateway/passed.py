"""Whose is each response the upstream keeps that a request passed through made.

A ``/v1/responses`` request without a code tool passes through to the upstream
unchanged, on the operator's key; with ``store`` (the default) the upstream
keeps the response in the operator's one account, and continues it for
whichever request names its id (``previous_response_id``). So every tenant's
conversations were every other tenant's to read on and continue, given an id
that leaked, and so were the operator's own; and a sandbox's code (which calls
the model with its tenant's token) could continue any conversation of its
tenant's other users.

Here each such response's owner is noted as it passes (its tenant, and the
sandbox whose code made it), before the client can see its id, and a request
may continue only its own: another's is not found (404), as at the upstream
for an id it never made. So is each of its output items: the upstream fills in
an input item that names one by its id (an item_reference, a reasoning item
sent back without its content) from what it keeps, whoever names it. Where
one tenant is all there is, an id made at the upstream directly (the
operator's clients) still passes; a sandbox's code continues only what its own
code made, whatever the tenants.
"""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator

from starlette.responses import Response

from shoal.storage import MetadataStore, PassedResponse
from shoal.streaming import close_iterator

log = logging.getLogger("shoal.gateway")

# As long as OpenAI keeps a stored response (30 days): past it, no one's to continue.
KEPT_SECONDS = 30 * 86400
# The largest event of a stream held whole to be read: response.created echoes
# the request's instructions and tools (an agent's run to hundreds of KiB).
# Past it the event goes by unread, and what it named is noted as no one's.
_EVENT_LIMIT = 32 * 1024 * 1024


class NotYours(LookupError):
    """The conversation named is another's (or no one's known here): 404."""


class NotThisSandbox(PermissionError):
    """A sandbox's code named its tenant's conversation that its own code did not make."""


class PassedResponses:
    def __init__(self, metadata: MetadataStore, tenants: int) -> None:
        self._metadata = metadata
        # Several tenants share the operator's upstream account.
        self.shared = tenants > 1

    async def check(self, tenant: str, scope: str | None, body: dict) -> None:
        """Whether the request may continue what it names, a response or an item
        of one; NotYours or NotThisSandbox."""
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            await self._owned(previous, tenant, scope,
                              f"Previous response with id '{previous}' not found.")
        items = body.get("input")
        named = {found for item in items if (found := _named_item(item)) is not None} if (
            isinstance(items, list)) else set()
        for item_id in sorted(named):
            await self._owned(item_id, tenant, scope, f"Item with id '{item_id}' not found.")

    async def _owned(self, kept_id: str, tenant: str, scope: str | None, missing: str) -> None:
        owner = await self._metadata.passed_response(kept_id)
        if owner is None or owner.created_at < time.time() - KEPT_SECONDS:
            if self.shared or scope is not None:
                raise NotYours(missing)
            return  # one tenant: the ids its clients made at the upstream are its own
        if owner.tenant != tenant:
            raise NotYours(missing)
        if scope is not None and owner.scope != scope:
            raise NotThisSandbox("this conversation was not started by this sandbox's code: "
                                 "code continues only the conversations it started")

    async def noted(self, response: Response, tenant: str, scope: str | None,
                    body: dict) -> Response:
        """The upstream's answer, its response's owner noted before its id is sent."""
        if response.status_code != 200 or body.get("store") is False:
            return response  # nothing kept upstream
        iterator = getattr(response, "body_iterator", None)
        if iterator is not None:
            response.body_iterator = self._noting(iterator, tenant, scope)
            return response
        try:
            made = json.loads(response.body)
        except ValueError:
            return response
        if isinstance(made, dict) and isinstance(made.get("id"), str):
            await self._note(made["id"], tenant, scope)
            output = made.get("output")
            for item in output if isinstance(output, list) else ():
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    await self._note(item["id"], tenant, scope)
        return response

    async def _noting(self, chunks: AsyncIterator[bytes], tenant: str,
                      scope: str | None) -> AsyncIterator[bytes]:
        events, noted = _Events(), set()
        try:
            async for chunk in chunks:
                for made in events.named(chunk):
                    if made not in noted:
                        noted.add(made)
                        await self._note(made, tenant, scope)
                yield chunk
        finally:
            await close_iterator(chunks)

    async def _note(self, kept_id: str, tenant: str, scope: str | None) -> None:
        """Whose is a response the upstream keeps, or an item of one (the upstream
        resolves either by its id alone)."""
        try:
            await self._metadata.note_passed_response(
                PassedResponse(kept_id, tenant, scope, time.time()))
        except Exception:  # noqa: BLE001 - the answer is the client's still
            # Unnoted, the conversation is refused later, never anyone else's.
            log.exception("could not note whose passed-through response %s is", kept_id)

    async def sweep(self) -> int:
        return await self._metadata.delete_passed_responses_before(time.time() - KEPT_SECONDS)


class _Events:
    """A stream's events, read as its chunks pass, for those that name what the
    upstream keeps: ``response.created`` its response, each
    ``response.output_item.added`` an item of it. Such an event is held until it
    is whole, however long (response.created echoes the request's instructions
    and tools: only the first 64 KiB were looked into, and a longer one left the
    response no one's, refused to its own tenant). Any other event goes by
    without being held."""

    _WANTED = (b"response.created", b"response.output_item.added")

    def __init__(self) -> None:
        self._held: list[bytes] = []  # the event so far, while it may be one of them
        self._size = 0
        self._skipping = False  # the event under way is another (or too long)
        self._named = False  # its first line has been read
        self._edge = b""  # the last byte read: a "\n" that may begin the blank line
        self._cr = b""  # a "\r" that may begin a CRLF cut between chunks

    def named(self, chunk: bytes) -> list[str]:
        """The ids the events that ``chunk`` makes whole name."""
        text, self._cr = self._cr + chunk, b""
        if text.endswith(b"\r"):
            text, self._cr = text[:-1], b"\r"
        text = text.replace(b"\r\n", b"\n")
        found: list[str] = []
        while text:
            end = (self._edge + text).find(b"\n\n")
            if end < 0:
                self._take(text)
                return found
            end -= len(self._edge)  # -1: the blank line began with the last byte read
            self._take(text[:max(end, 0)])
            event = None if self._skipping else b"".join(self._held)
            self._held, self._size, self._edge = [], 0, b""
            self._skipping = self._named = False
            text = text[end + 2:]
            made = _named_by(event) if event is not None else None
            if made is not None:
                found.append(made)
        return found

    def _take(self, piece: bytes) -> None:
        if not piece:
            return
        self._edge = piece[-1:]
        if self._skipping:
            return
        self._held.append(piece)
        self._size += len(piece)
        if self._size > _EVENT_LIMIT:
            log.warning("a passed-through stream's event passed %d bytes unread: the response "
                        "it names, if any, is no one's", _EVENT_LIMIT)
            self._held, self._skipping = [], True
            return
        if self._named:
            return
        line, ended, _ = b"".join(self._held).partition(b"\n")
        if ended or len(line) > 64:
            self._named = True
            if line.startswith(b"event:") and line[6:].strip() not in self._WANTED:
                self._held, self._skipping = [], True  # another event: not held


def _named_by(event: bytes) -> str | None:
    """The id a whole event names: its response's (response.created), or its
    item's (response.output_item.added); None for another."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                      if line.startswith(b"data:"))
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    kind = parsed.get("type")
    made = (parsed.get("response") if kind == "response.created"
            else parsed.get("item") if kind == "response.output_item.added" else None)
    made = made.get("id") if isinstance(made, dict) else None
    return made if isinstance(made, str) else None


def _named_item(item: object) -> str | None:
    """The id of a stored item an input item names, for the upstream to fill in
    from what it keeps: an item_reference (whose type may be left out: an id
    alone), or a reasoning item sent back without its content."""
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        return None
    kind = item.get("type")
    if kind == "item_reference" or (kind is None and "role" not in item
                                    and "content" not in item) or (
            kind == "reasoning" and not item.get("encrypted_content")):
        return item["id"]
    return None
