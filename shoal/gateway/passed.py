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
for an id it never made. Where one tenant is all there is, an id made at the
upstream directly (the operator's clients) still passes; a sandbox's code
continues only what its own code made, whatever the tenants.
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
# How far into a stream its first event (response.created, which names the
# response) is looked for.
_CREATED_WITHIN = 64 * 1024


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
        """Whether the request may continue what it names; NotYours or NotThisSandbox."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return
        owner = await self._metadata.passed_response(previous)
        if owner is None or owner.created_at < time.time() - KEPT_SECONDS:
            if self.shared or scope is not None:
                raise NotYours(f"Previous response with id '{previous}' not found.")
            return  # one tenant: the ids its clients made at the upstream are its own
        if owner.tenant != tenant:
            raise NotYours(f"Previous response with id '{previous}' not found.")
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
        return response

    async def _noting(self, chunks: AsyncIterator[bytes], tenant: str,
                      scope: str | None) -> AsyncIterator[bytes]:
        seen: bytes | None = b""
        try:
            async for chunk in chunks:
                if seen is not None:
                    seen += chunk
                    made = _created_id(seen)
                    if made is not None:
                        await self._note(made, tenant, scope)
                    if made is not None or len(seen) > _CREATED_WITHIN:
                        seen = None
                yield chunk
        finally:
            await close_iterator(chunks)

    async def _note(self, response_id: str, tenant: str, scope: str | None) -> None:
        try:
            await self._metadata.note_passed_response(
                PassedResponse(response_id, tenant, scope, time.time()))
        except Exception:  # noqa: BLE001 - the answer is the client's still
            # Unnoted, the conversation is refused later, never anyone else's.
            log.exception("could not note whose passed-through response %s is", response_id)

    async def sweep(self) -> int:
        return await self._metadata.delete_passed_responses_before(time.time() - KEPT_SECONDS)


def _created_id(stream: bytes) -> str | None:
    """The response id a stream's ``response.created`` event names, once the
    event is whole in ``stream``; None before (or if it names none)."""
    for event in stream.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]:
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                          if line.startswith(b"data:"))
        try:
            parsed = json.loads(data)
        except ValueError:
            continue
        if isinstance(parsed, dict) and parsed.get("type") == "response.created":
            made = parsed.get("response")
            made = made.get("id") if isinstance(made, dict) else None
            return made if isinstance(made, str) else None
    return None
