"""The cluster front end: the same API as a single server, routed to sandbox hosts.

A front end keeps no state of its own. For each request it finds the host that
holds what the request is about and forwards it there unchanged, streaming the
answer back (server-sent events included):

- ``/sessions/{id}…`` and ``/v1/code-execution/runs/{id}…``: the host whose key
  the id starts with (hosts make the ids). A session whose host is gone is
  gone (404); a finished run is answered by any host from its stored record.
- a container (in the path, ``scope_id``, or a top-level ``container`` of the
  body): the host it is placed on, a row in the cluster's database. A
  container placed nowhere yet, or on a host that is gone, goes (atomically)
  where Ray's scheduler places it, which restores it from its snapshot.
- a new session or run: where Ray's scheduler places it (``Membership.place``);
- anything else (a stored record, a file), and anything without a tenant's
  token (which a host refuses): any host.

Whatever the first guess, the host decides: one that is asked about a
container another host holds answers 421 naming the holder, and the front end
sends the request there instead (the request's body is kept for that).
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shoal import __version__
from shoal.api.auth import OPEN_TENANT, TokenTable, operator_tokens_of, bearer_token
from shoal.api.body_limits import BodyLimits, Budget
from shoal.api._gateway import unless_gone
from shoal.api.stalled import ResponseCut, StalledResponses
from shoal.streaming import StreamingBody
from shoal.api.errors import PLACEMENT_HEADER, error_response
from shoal.api.observability import ALIAS_PREFIX, request_id_from
from shoal.logs import request_context
from shoal.config import MiB, Settings, read_secret
from shoal.storage import StoreUnavailable, open_metadata

from .host import key_length
from .membership import Host, Membership, NoHost
from .slots import PROBE_HEADER, Probe

log = logging.getLogger("shoal.cluster")

_SESSION = re.compile(r"^/sessions/([^/]+)")
_RUN = re.compile(r"^/v1/code-execution/runs/cexrun_([^/]+)")
_CONTAINER_PATHS = (re.compile(r"^/v1/containers/([^/]+)"),
                    re.compile(r"^/api/v1/app/thread/([^/]+)"))
# Hop-by-hop fields (RFC 9110 7.6.1, and Keep-Alive and Proxy-Connection that
# HTTP/1.0 clients still send): they describe one connection, so they stop here
# either way, as does any field a Connection field names.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
# httpx writes the Content-Length of the body it sends; only the front end
# places (a client's own probe header goes nowhere). The client's Host goes on:
# a host makes absolute URLs (a redirect's Location) from it, and with its own
# address there it sent clients past the front end.
_NOT_SENT = (b"content-length", PROBE_HEADER.encode())
# The front end's own server stamps Date and Server: the host's would repeat
# them (a second Date is invalid). The host's Content-Length is kept: a
# download's length, and a HEAD's.
_NOT_RELAYED = (b"date", b"server", PROBE_HEADER.encode())
_ATTEMPTS = 3
# What starts a sandbox with no container named (a gateway's turn may run
# code): placed by Ray, where everything else goes to any host.
_NEW_SANDBOX = {"/sessions", "/v1/code-execution/runs", "/v1/messages", "/v1/responses"}


def end_to_end(raw: list[tuple[bytes, bytes]],
               dropped: tuple[bytes, ...] = ()) -> list[tuple[bytes, bytes]]:
    """The fields of ``raw`` to pass on, each as it came and in its order: a
    repeated one stays repeated (Set-Cookie cannot be joined into one line)."""
    named = {token.strip().lower() for name, value in raw if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in raw
            if (lower := name.lower()) not in _HOP and lower not in named
            and lower not in dropped]


class RequestIds:
    """Each request's id, as a host's edge gives it (the client's X-Request-Id,
    unless a Connection field names it, or a new one), sent on to the host, so
    both log the call under one id; and on the front end's own answers (its
    503s and 504s said nothing a client could quote)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(end_to_end(scope["headers"]))
        scope.setdefault("state", {})["request_id"] = request_id
        header = request_id.encode()

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers += [(b"x-request-id", header), (b"request-id", header)]
                message["headers"] = headers
            await send(message)

        reset = request_context.set({"request_id": request_id})
        try:
            await self.app(scope, receive, with_id)
        finally:
            request_context.reset(reset)


class _Body:
    """A request's body as it arrived, kept to be sent again (a host's 421) and
    sent on in those same chunks. Joined, it was held twice at once (the chunks
    and the whole), and the whole copied again into the socket's buffer on its
    way to the host: request_buffer_mib bounds it once."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.length = sum(map(len, chunks))
        self._parsed: object = ...

    def __bool__(self) -> bool:
        return self.length > 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def parsed(self) -> object:
        """The body as JSON (None if it is not), parsed once: it is asked again
        on every resend."""
        if self._parsed is ...:
            try:
                self._parsed = json.loads(b"".join(self.chunks))
            except ValueError:
                self._parsed = None
        return self._parsed


def _named_container(body: dict) -> str | None:
    """The container a JSON body names: a run's or a session's ``container``,
    Anthropic's ``container`` (an id, or an object with one), or an OpenAI code
    interpreter tool's ``container`` id."""
    candidates = [body.get("container"), body.get("container_id")]
    if isinstance(body.get("container"), dict):
        candidates.append(body["container"].get("id"))
    tools = body.get("tools")
    if isinstance(tools, list):
        candidates += [tool.get("container") for tool in tools if isinstance(tool, dict)]
    return next((c for c in candidates if isinstance(c, str) and c), None)


def _json_body(content_type: str) -> bool:
    """Whether a host reads a body of this type as JSON, as FastAPI does: with no
    type at all, or any ``json`` or ``…+json`` one. (A front end that read fewer
    missed the container such a body names: it sent the request where Ray placed
    it, whose host answered 421 naming the holder, and when the holder was gone
    the container never moved, a 503 every time.)"""
    if not content_type:
        return True
    subtype = content_type.split(";", 1)[0].strip().lower().partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


class FrontEnd:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tokens = TokenTable.parse(settings.tokens, settings.operator_tokens)
        # The hosts' /health says why one is degraded to the operator only.
        operators = operator_tokens_of(settings.operator_tokens)
        self.membership = Membership(settings.cluster, operators[0] if operators else None)
        self.metadata = open_metadata(settings.data_dir, read_secret(settings.database_url))
        # read bounds each wait on a host for bytes (for its answer to begin, and
        # between the parts of a streamed one): a host that holds the
        # connection and sends nothing (stopped, wedged) held its client for ever.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=settings.host_idle_seconds, write=60.0,
                                  pool=30.0),
            # One connection to a host per client call in flight, and a client
            # connection carries one call at a time: with fewer (there were
            # 1,024 for 4,096 clients) a call past them waited 30 s for a 503.
            limits=httpx.Limits(max_connections=settings.max_connections,
                                max_keepalive_connections=min(256, settings.max_connections)),
            follow_redirects=False, trust_env=False)

    async def start(self) -> None:
        await self.metadata.open()
        await self.membership.start()

    async def close(self) -> None:
        await self.membership.close()
        await self.client.aclose()
        await self.metadata.close()

    # -- routing ------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str | None:
        if not self.tokens.enabled:
            return OPEN_TENANT
        token = bearer_token(request)
        return self.tokens.tenant_for(token) if token else None

    @staticmethod
    def _path(request: Request) -> str:
        """The route a host will see (Zylon's clients prefix every route with an alias)."""
        path = request.url.path
        return path[len(ALIAS_PREFIX):] if path.startswith(ALIAS_PREFIX + "/") else path

    def _container_of(self, request: Request, body: _Body) -> str | None:
        path = self._path(request)
        for pattern in _CONTAINER_PATHS:
            match = pattern.match(path)
            if match:
                return match.group(1)
        if request.query_params.get("scope_id"):
            return request.query_params["scope_id"]
        if body and _json_body(request.headers.get("content-type", "")):
            parsed = body.parsed()
            if isinstance(parsed, dict):
                return _named_container(parsed)
        return None

    async def _placed(self, tenant: str, container_id: str,
                      holder: str | None = None) -> tuple[Host, Probe | None]:
        """The host holding the container; placed by Ray first if it is on none
        yet, or moved if the one it was on is gone."""
        if holder is None:
            holder = await self.metadata.placement(tenant, container_id)
        if holder is None:
            return await self.membership.place()
        host = self.membership.alive(holder)
        if host is not None:
            return host, None
        if not self.membership.gone(holder):
            # Ray reports its node alive: its host is starting (or restarting) and
            # may hold the container's latest files; it does not move.
            raise NoHost("the container's sandbox host is starting; retry")
        chosen, probe = await self.membership.place()
        try:
            moved = await self.metadata.claim_placement(tenant, container_id, chosen.key,
                                                        replacing=holder)
        except BaseException:
            self.membership.handed_over(probe, adopted=False)
            raise
        if moved != chosen.key:  # another front end moved it first
            self.membership.handed_over(probe, adopted=False)
            host = self.membership.alive(moved)
            if host is None:
                raise NoHost("the container's sandbox host is gone; retry")
            return host, None
        log.info("container %s moves from gone host %s to %s", container_id, holder, chosen.key)
        return chosen, probe

    async def _target(self, request: Request,
                      body: _Body) -> tuple[Host, Probe | None] | Response:
        path = self._path(request)
        match = _SESSION.match(path)
        if match and path != "/sessions":
            host = self.membership.alive(match.group(1)[:key_length()])
            if host is not None:
                return host, None
            if request.method == "DELETE" and path == match.group(0):
                return Response(status_code=204)  # gone with its host: as released
            return error_response(request, 404, f"no session {match.group(1)!r}")
        match = _RUN.match(path)
        if match:
            host = self.membership.alive(match.group(1)[:key_length()])
            return host or self.membership.any(), None  # else the stored record answers
        tenant = self._tenant(request)
        container_id = self._container_of(request, body)
        if tenant is not None and container_id is not None:
            return await self._placed(tenant, container_id)
        if request.method == "POST" and path in _NEW_SANDBOX and tenant is not None:
            return await self.membership.place()
        # A request without a tenant's token (a host answers 401) asks Ray for no
        # slot: else each took one while it went to a host and back, a flood of
        # them queued on Ray's scheduler before every tenant's placements, and on
        # a full cluster such a client was told to retry (503), never that its
        # token is wrong.
        return self.membership.any(), None

    # -- forwarding ---------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        try:
            return await self._handle(request)
        except ClientDisconnect:
            # No one reads this answer; what matters is that the call was let go
            # (its connection to the host closed, so the host ends it too).
            return Response(status_code=499)

    async def _handle(self, request: Request) -> Response:
        try:
            # Bounded by BodyLimits, as on a host.
            body = _Body([chunk async for chunk in request.stream() if chunk])
        except HTTPException as exc:
            return error_response(request, exc.status_code, exc.detail)
        try:
            target = await self._target(request, body)
        except (NoHost, StoreUnavailable) as exc:  # a placement it cannot look up, too
            return error_response(request, 503, str(exc))
        if isinstance(target, Response):
            return target
        host, probe = target
        if self.membership.unresponsive(host):  # never one placed anew: place() skips it
            # Each call to it waited host_idle_seconds for its 504.
            return error_response(request, 503, "the sandbox host is not answering; retry")
        for attempt in range(_ATTEMPTS):
            try:
                # A client that hangs up before its answer begins: the front end
                # went on waiting, so the host never saw it leave and ran its call
                # (a model turn, its upstream connection held) to the end.
                upstream = await unless_gone(request, self._send(host, request, body, probe))
            except httpx.ReadTimeout:
                # The host took the request and sent nothing for host_idle_seconds
                # (stopped, wedged): httpx closed that connection, so its late
                # answer never reaches another call. It may yet run the call.
                if probe is not None:
                    self.membership.handed_over(probe, adopted=False)
                log.warning("sandbox host %s sent nothing for %gs: the call is a 504",
                            host.key, self.settings.host_idle_seconds,
                            extra={"method": request.method, "path": request.url.path})
                return error_response(request, 504, "the sandbox host did not answer in time; "
                                      "retry", headers={"Retry-After": "1"})
            except httpx.TransportError as exc:
                placed, probe = probe, None
                if placed is not None:
                    self.membership.handed_over(placed, adopted=False)
                # The host stopped answering (its node going down): Ray will say so.
                # A new sandbox whose host refused the connection (nothing was
                # made there) is placed again, that host passed over until it
                # answers its next poll.
                if (not isinstance(exc, httpx.ConnectError) or placed is None
                        or attempt == _ATTEMPTS - 1
                        or self._container_of(request, body) is not None):
                    return error_response(request, 503, "the sandbox host did not answer; retry")
                host.silent += 1
                try:
                    host, probe = await self.membership.place()
                except NoHost as placing:
                    return error_response(request, 503, str(placing))
                continue
            except BaseException:  # cancelled (the server stopping): the probe goes back
                if probe is not None:
                    self.membership.handed_over(probe, adopted=False)
                raise
            if probe is not None:
                # The host took the probe's slot over with what it accepted, or not.
                self.membership.handed_over(
                    probe, adopted=upstream.headers.get(PROBE_HEADER) == "adopted")
                probe = None
            holder = upstream.headers.get(PLACEMENT_HEADER)
            if upstream.status_code != 421 or holder is None:
                response = StreamingBody(_relayed(upstream, host),
                                         status_code=upstream.status_code)
                response.raw_headers = end_to_end(upstream.headers.raw, _NOT_RELAYED)
                return response
            await upstream.aclose()
            tenant = self._tenant(request)
            container_id = self._container_of(request, body)
            try:
                if tenant is not None and container_id is not None:
                    host, probe = await self._placed(tenant, container_id, holder)
                else:
                    host = self.membership.alive(holder) or self.membership.any()
            except (NoHost, StoreUnavailable) as exc:
                return error_response(request, 503, str(exc))
        if probe is not None:
            self.membership.handed_over(probe, adopted=False)
        return error_response(request, 503, "no sandbox host took the request (hosts stopping, "
                              "or the container's placement kept moving); retry")

    async def _send(self, host: Host, request: Request, body: _Body,
                    probe: Probe | None) -> httpx.Response:
        headers = end_to_end(request.headers.raw, _NOT_SENT + (b"x-request-id",))
        headers.append((b"x-request-id", request.scope["state"]["request_id"].encode()))
        if probe is not None:
            headers.append((PROBE_HEADER.encode(), probe.name.encode()))
        # The path as the client sent it (still percent-encoded), and its query as is.
        raw = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string") or b""
        url = httpx.URL(host.url).copy_with(raw_path=raw + (b"?" + query if query else b""))
        if body:
            headers.append((b"content-length", str(body.length).encode()))
        outgoing = self.client.build_request(request.method, url, headers=headers,
                                             content=body if body else None)
        return await self.client.send(outgoing, stream=True)


class HostStoppedSending(ResponseCut):
    """A host's streamed answer broke off, or went silent for host_idle_seconds."""


async def _relayed(upstream: httpx.Response, host: Host) -> AsyncIterator[bytes]:
    """The host's answer as it arrives. If the host stops mid-answer, the
    client's response is cut (its connection closed), never ended as if whole."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.warning("sandbox host %s stopped sending mid-answer (%s): its client's response "
                    "is cut", host.key, type(exc).__name__)
        raise HostStoppedSending() from exc
    finally:
        await upstream.aclose()


def create_front_end(settings: Settings) -> Starlette:
    front = FrontEnd(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await front.start()
        yield
        await front.close()

    async def health(request: Request) -> Response:
        hosts = front.membership.hosts
        up = [h for h in hosts.values() if h.healthy]
        # hosts: serving what they hold; ready: taking new sessions and containers too.
        return JSONResponse({"status": "ok" if up else "degraded", "role": "front end",
                             "version": __version__, "hosts": len(hosts), "ready": len(up),
                             # What Ray's scheduler has left to place (shoal.cluster.slots).
                             "free_slots": front.membership.free_slots})

    async def readyz(request: Request) -> Response:
        if request.app.state.draining:  # SIGTERM (shoal.draining): out of the balancer
            return JSONResponse({"ready": False, "reasons": ["draining"]}, status_code=503,
                                headers={"Retry-After": "1"})
        up = any(h.healthy for h in front.membership.hosts.values())
        return JSONResponse({"ready": up}, status_code=200 if up else 503)

    async def livez(request: Request) -> Response:
        return JSONResponse({"live": True})

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    # The bodies it keeps to resend: bounded each and all together, as on a host.
    middleware = [Middleware(RequestIds),
                  Middleware(BodyLimits, cap=settings.request_cap,
                             budget=Budget(settings.request_buffer_mib * MiB),
                             idle_seconds=settings.request_body_idle_seconds),
                  Middleware(StalledResponses, seconds=settings.response_stall_seconds)]
    app = Starlette(lifespan=lifespan, middleware=middleware, routes=[
        Route("/health", health), Route("/readyz", readyz), Route("/livez", livez),
        Route("/{path:path}", front.handle, methods=methods)])
    app.state.front_end = front
    app.state.settings = settings
    app.state.draining = False
    return app
