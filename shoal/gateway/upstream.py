"""The model provider behind the gateway: one HTTP client per dialect.

Only the operator's key ever reaches the upstream; the client's bearer token
authenticated it to Shoal and stops there. Requests the gateway has nothing to
add to pass through untouched (streaming included); the tool loop's own calls
are always streamed, so a streaming client sees the model's deltas as they
come, and a non-streaming one gets the same events assembled.

Upstream failures are never our 500: a status from the upstream comes back as
:class:`UpstreamError` carrying that status, its body and its retry headers,
and an unreachable upstream is a 502 with the reason.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
from httpx_sse import aconnect_sse
from starlette.requests import Request
from starlette.responses import Response

from shoal.streaming import StreamingBody, relayed

log = logging.getLogger("shoal.gateway")

# Response headers worth passing back from the upstream.
_PASSED_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry", "content-type")
# Request headers the client may send that mean something to the upstream.
_FORWARDED = {"anthropic": ("anthropic-version", "anthropic-beta"), "openai": ("openai-beta",)}
# A model may think for minutes; a connection of the shared pool is waited for
# only briefly: when every one is in use, the caller hears so (a 503), instead
# of queueing behind other tenants' long calls for as long as they last.
_TIMEOUT = httpx.Timeout(600.0, connect=10.0, pool=10.0)
_BUSY = ("every connection to the upstream model is in use; retry in a moment")


class UpstreamError(Exception):
    """The upstream answered an error (or could not be reached: status 502)."""

    def __init__(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.headers = headers or {}

    @property
    def message(self) -> str:
        body = self.body
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return error["message"]
            if isinstance(body.get("message"), str):
                return body["message"]
        if isinstance(body, str) and body.strip():
            return body.strip()[:2000]
        return f"the upstream model answered HTTP {self.status}"

    def retry_headers(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if k in ("retry-after", "retry-after-ms",
                                                             "x-should-retry")}


class UpstreamNotConfigured(Exception):
    """No upstream URL is configured for this dialect."""


class UnsendableHeader(ValueError):
    """A header the client sent for the upstream that cannot be sent on; a 400."""


def check_forwarded(dialect: str, incoming) -> None:
    """UnsendableHeader unless the headers passed on to the upstream can be sent:
    httpx sends header values as ASCII, and the client's (read as latin-1) may
    hold any byte past it, which raised from inside the call as a 500."""
    for name in _FORWARDED.get(dialect, ()):
        value = incoming.get(name)
        if value is not None and not value.isascii():
            raise UnsendableHeader(f"the {name} header must be ASCII")


@dataclass
class Timing:
    """Where one gateway request's time went: waiting for the upstream, running
    code in the sandbox, and the rest (the gateway's own work)."""

    started: float = field(default_factory=time.perf_counter)
    upstream: float = 0.0
    sandbox: float = 0.0
    round_trips: int = 0

    def server_timing(self) -> str:
        """The request's figures as an HTTP ``Server-Timing`` header value."""
        total = time.perf_counter() - self.started
        gateway = max(0.0, total - self.upstream - self.sandbox)
        return (f"upstream;dur={self.upstream * 1000:.3f}, sandbox;dur={self.sandbox * 1000:.3f}, "
                f"gateway;dur={gateway * 1000:.3f};desc=\"{self.round_trips} round trips\"")


@dataclass
class Upstream:
    """One provider endpoint: its base URL (without ``/v1``), key and dialect."""

    dialect: str  # "anthropic" | "openai"
    base_url: str
    key: str
    client: httpx.AsyncClient
    auth: str = "default"  # anthropic: x-api-key (default) or bearer
    extra_headers: dict[str, str] = field(default_factory=dict)

    def url(self, path: str) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            base = base[:-3]
        return base + path

    def headers(self, incoming: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        for name in _FORWARDED.get(self.dialect, ()):
            if incoming and name in incoming:
                headers[name] = incoming[name]
        if self.dialect == "anthropic":
            headers.setdefault("anthropic-version", "2023-06-01")
            if self.key:
                if self.auth == "bearer":
                    headers["authorization"] = f"Bearer {self.key}"
                else:
                    headers["x-api-key"] = self.key
        elif self.key:
            headers["authorization"] = f"Bearer {self.key}"
        headers.update(self.extra_headers)
        return headers

    # -- the tool loop's calls: always streamed ----------------------------------------------
    async def events(self, path: str, body: dict, incoming: dict[str, str] | None = None,
                     timing: Timing | None = None) -> AsyncIterator[tuple[str, dict]]:
        """``(event name, data)`` of a streamed call; UpstreamError before the first
        event if the upstream refuses, or in the middle if the stream breaks. The
        time spent waiting for the upstream is added to ``timing``."""
        timing = timing or Timing()
        waited_since = time.perf_counter()
        try:
            async with aconnect_sse(self.client, "POST", self.url(path),
                                    json={**body, "stream": True},
                                    headers=self.headers(incoming), timeout=_TIMEOUT) as source:
                response = source.response
                if response.status_code >= 400:
                    await response.aread()
                    raise _refusal(response)
                async for sse in source.aiter_sse():
                    now = time.perf_counter()
                    timing.upstream += now - waited_since
                    if not sse.data or sse.data == "[DONE]":
                        continue
                    try:
                        data = json.loads(sse.data)
                    except ValueError:
                        raise UpstreamError(502, f"the upstream sent an event that is not JSON: "
                                                 f"{sse.data[:200]!r}") from None
                    if not isinstance(data, dict):
                        continue
                    name = sse.event if sse.event and sse.event != "message" else str(
                        data.get("type", ""))
                    if name == "error":
                        raise UpstreamError(_status_of_error_event(data), data)
                    yield name, data
                    waited_since = time.perf_counter()
                timing.upstream += time.perf_counter() - waited_since
        except httpx.PoolTimeout:
            raise UpstreamError(503, _BUSY, {"retry-after": "1"}) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"the upstream model could not be reached: {exc}") from None

    # -- pass-through ------------------------------------------------------------------------
    async def forward(self, request: Request, path: str, body: bytes) -> Response:
        """Send a request on unchanged and answer with whatever the upstream answers."""
        try:
            upstream_request = self.client.build_request(
                "POST", self.url(path), content=body,
                headers=self.headers({k.lower(): v for k, v in request.headers.items()}),
                timeout=_TIMEOUT)
            response = await self.client.send(upstream_request, stream=True)
        except httpx.PoolTimeout:
            raise UpstreamError(503, _BUSY, {"retry-after": "1"}) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"the upstream model could not be reached: {exc}") from None
        if response.status_code in _OPERATORS_FAULT:
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise _refusal(response)
        headers = {k: v for k, v in response.headers.items() if k.lower() in _PASSED_HEADERS}
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingBody(relayed(response), status_code=response.status_code,
                                 headers=headers)
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return Response(content, status_code=response.status_code, headers=headers)


# The status a streamed error event would have had as a response: a client (or
# the gateway in front of us) that backs off or falls back on a 529 or a 429
# must see one, not a 502, when the model was overloaded after it began.
_ERROR_EVENT_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                       "permission_error": 403, "not_found_error": 404,
                       "request_too_large": 413, "rate_limit_error": 429,
                       "rate_limit_exceeded": 429, "api_error": 500, "overloaded_error": 529}


def _status_of_error_event(data: dict) -> int:
    error = data.get("error")
    kind = error.get("type") if isinstance(error, dict) else data.get("code")
    return _ERROR_EVENT_STATUS.get(kind, 502) if isinstance(kind, str) else 502


# The upstream refusing the operator's key: the client's own credentials were
# good (they got it this far), and a 401 or 403 passed on told its SDK that they
# were not ("invalid x-api-key"), where the fault is the server's to fix.
_OPERATORS_FAULT = (401, 403)


def _refusal(response: httpx.Response) -> UpstreamError:
    refused = UpstreamError(response.status_code, _body_of(response), _headers_of(response))
    if response.status_code not in _OPERATORS_FAULT:
        return refused
    # Its words are the operator's (OpenAI's name part of the key): logged, not sent.
    log.warning("the upstream model refused the operator's key: HTTP %d: %s",
                response.status_code, refused.message)
    return UpstreamError(502, f"the upstream model refused this server's credentials (HTTP "
                              f"{response.status_code}); the operator must fix its upstream key")


def _body_of(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text


def _headers_of(response: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items()}
