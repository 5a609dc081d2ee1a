"""The host's side of egress: an HTTP proxy that decides every connection.

Sandboxes reach it only through their relay (:mod:`shoal.agent.relay`), over
one Unix socket bound into every sandbox. The kernel says who is calling:
``SO_PEERCRED`` gives the connecting process's host uid, and every live
sandbox has a uid of its own. A connection from any other uid is closed
unanswered.

It speaks what the sandbox's clients speak through ``HTTP(S)_PROXY``:

- ``CONNECT host:port``: a tunnel (HTTPS, or anything else over TCP); a TLS
  client in it must ask for that host, not another one the address serves
  (:mod:`.sni`);
- an absolute-form request (``GET http://host/path``): plain HTTP, forwarded
  one request per connection.

Each destination goes through the operator's allowlist, narrowed by the
container's own ``network_policy``. The broker resolves names itself and
checks every address, so a name cannot lead to an address the policy does not
allow (:mod:`.policy`). It connects to the address it checked, never to the
name again.

The model host (``shoal.internal``) is Shoal's own gateway. There the broker
takes the sandbox's model token (:mod:`.tokens`), checks that the token
belongs to this sandbox's container, and forwards the request to the gateway
as the token's tenant. The gateway adds the operator's key. A container's
``domain_secrets`` are injected here too. The sandbox holds a placeholder, and
the broker puts the real value in its place on plain-HTTP requests to that
domain. A TLS tunnel is opaque to the broker, so a secret cannot reach inside
one.

Everything is asyncio on the API's event loop. Names are resolved in the
loop's executor. Each sandbox has a cap on connections and on bytes per second
(one sandbox's download must not take the loop every other tenant's requests
run on), counted per lease (the sandbox object, not its uid: uids are reused).
A connection lives no longer than the sandbox that opened it: once a second
the leases are checked, and the connections of one that ended are closed, so a
dead sandbox's hung transfers neither hold the host's sockets nor count
against whoever gets its uid next.
The bytes and connections of each container are counted for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from . import sni
from .policy import Allowlist, Narrowed
from .tokens import MODEL_HOST, ModelTokens, TokenRefused

log = logging.getLogger("shoal.egress")

_HEAD_LIMIT = 64 * 1024
_CHUNK = 64 * 1024
_CONNECT_SECONDS = 10.0
# How often the connections of sandboxes that ended are looked for and closed.
_SWEEP_SECONDS = 1.0
# What a sandbox's model token reaches of Shoal's API: the model, nothing else.
_MODEL_PATHS = ("/v1/messages", "/v1/responses")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization",
               "proxy-authenticate", "te", "trailer", "upgrade"}


@dataclass
class Grant:
    """What one sandbox may reach now: decided by the layer that leased it."""

    tenant: str
    container_id: str | None
    # The container's own allowlist; None: the operator's list as it is.
    allowed: Allowlist | None = None
    # placeholder -> (domain, real value), for the container's domain_secrets.
    secrets: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class Traffic:
    bytes_out: int = 0
    bytes_in: int = 0
    connections: int = 0
    refused: int = 0


class _Rate:
    """A token bucket: ``rate`` bytes a second, bursts of a second's worth."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._tokens = float(rate)
        self._at = time.monotonic()

    async def spend(self, size: int) -> None:
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate) - size
        self._at = now
        if self._tokens < 0:  # in debt: paid back before the next chunk moves
            await asyncio.sleep(-self._tokens / self.rate)


@dataclass(eq=False)
class _Owned:
    """The open connections of one lease: its uid, the tasks serving them, and
    the rate all of them share."""

    uid: int
    rate: _Rate
    scope: str = ""  # whose traffic it counts (shoal_egress_* in /metrics)
    tasks: set = field(default_factory=set)


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class EgressBroker:
    def __init__(self, socket_dir: Path, operator: Allowlist,
                 lease_of: Callable[[int], tuple[object, Grant | None] | None],
                 tokens: ModelTokens, gateway: tuple[str, int] | None, internal_secret: str,
                 max_connections: int = 32, bytes_per_second: int = 64 * 1024 * 1024) -> None:
        """``lease_of(uid)``: the live sandbox running as ``uid`` (any object that
        is the same for as long as that sandbox lives) and its grant; None when
        no sandbox runs as ``uid``."""
        self.socket_dir = socket_dir
        self._operator = operator
        self._lease_of = lease_of
        self._tokens = tokens
        self._gateway = gateway
        self._internal_secret = internal_secret
        self._max_connections = max_connections
        self._bytes_per_second = bytes_per_second
        self._open: dict[object, _Owned] = {}
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / "proxy.sock"

    async def start(self) -> None:
        self.socket_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.socket_dir, 0o755)
        self.socket_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound through the directory's fd: the path may be longer than a sockaddr holds.
        directory = os.open(self.socket_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{directory}/proxy.sock")
        finally:
            os.close(directory)
        os.chmod(self.socket_path, 0o666)  # any sandbox uid connects; SO_PEERCRED decides
        sock.listen(1024)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=_HEAD_LIMIT)
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    # -- accounting ---------------------------------------------------------------------------
    @staticmethod
    def live_scopes(sandboxes) -> set[str]:
        return {sandbox.egress_grant.container_id for sandbox in sandboxes
                if sandbox.egress_grant is not None and sandbox.egress_grant.container_id}

    def traffic_of(self, live: set[str]) -> list[tuple[str, Traffic]]:
        """Counters of the scopes still live; the others' are forgotten."""
        snapshot = list(self.traffic.items())  # one C call: safe beside the event loop
        for scope, _ in snapshot:
            if scope not in live:
                self.traffic.pop(scope, None)
        return sorted((scope, traffic) for scope, traffic in snapshot if scope in live)

    @property
    def open_connections(self) -> int:
        # Read from /metrics' worker thread while the loop changes the dict: a
        # snapshot first (one C call), as traffic_of does.
        return sum(len(owned.tasks) for owned in list(self._open.values()))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_SECONDS)
            try:
                self._sweep()
            except Exception:  # noqa: BLE001 - one bad round must not end the sweeping
                log.exception("sweeping the egress connections of ended sandboxes failed")

    def _sweep(self) -> None:
        """Close the connections of leases that ended (their sandbox stopped, or its
        uid serves another sandbox now), and forget the leases: a lease's entry
        (and its rate) lasts as long as its sandbox, not its connections, so a
        sandbox that reconnects does not get a fresh second's burst each time."""
        for owner, owned in list(self._open.items()):
            lease = self._lease_of(owned.uid)
            if lease is not None and lease[0] is owner:
                continue
            if owned.tasks:
                log.info("closing %d egress connections of a sandbox that ended",
                         len(owned.tasks))
            for task in owned.tasks:
                task.cancel()
            del self._open[owner]
            # Its traffic too, unless a live lease counts into it (a container's
            # next sandbox): /metrics shows live scopes only, and a server never
            # scraped kept one entry per session that ever connected.
            if not any(other.scope == owned.scope for other in self._open.values()):
                self.traffic.pop(owned.scope, None)

    # -- one connection ----------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        uid = _peer_uid(writer.get_extra_info("socket"))
        lease = self._lease_of(uid) if uid is not None else None
        owner, grant = lease if lease is not None else (None, None)
        if grant is None:  # not a live sandbox: no answer at all
            writer.close()
            self._tasks.discard(task)
            return
        scope = grant.container_id or f"uid:{uid}"
        traffic = self.traffic[scope]
        owned = self._open.get(owner)
        if owned is None:
            owned = self._open[owner] = _Owned(uid, _Rate(self._bytes_per_second), scope)
        if len(owned.tasks) >= self._max_connections:
            traffic.refused += 1
            try:
                await _answer(writer, 429, f"at most {self._max_connections} connections at once")
            finally:
                writer.close()
                self._tasks.discard(task)
            return
        owned.tasks.add(task)
        traffic.connections += 1
        try:
            await self._proxy(reader, writer, grant, traffic, owned.rate)
        except _Refused as refusal:
            traffic.refused += 1
            log.info("egress refused: %s", refusal, extra={"tenant": grant.tenant,
                                                            "container": grant.container_id})
            await _answer(writer, refusal.status, str(refusal))
        except sni.Refused as refusal:  # after the tunnel opened: TLS's alert said it
            traffic.refused += 1
            log.info("egress refused a tunnel's handshake: %s", refusal,
                     extra={"tenant": grant.tenant, "container": grant.container_id})
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # its sandbox ended, or the broker is closing
        finally:
            owned.tasks.discard(task)  # the entry itself stays until the lease ends (_sweep)
            writer.close()
            self._tasks.discard(task)

    async def _proxy(self, reader, writer, grant: Grant, traffic: Traffic, rate: _Rate) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(431, "request head too large") from None
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target, _, version = rest.partition(" ")
        if not version.startswith("HTTP/1."):
            raise _Refused(400, "not an HTTP/1.x proxy request")
        headers = [(name.strip(), value.strip()) for name, _, value in
                   (line.partition(":") for line in lines[1:] if line)]
        if method == "CONNECT":
            host, port = _host_port(target, None)
            if host == MODEL_HOST:
                raise _Refused(403, f"{MODEL_HOST} is plain HTTP: use http://{MODEL_HOST}")
            upstream = await self._open_checked(grant, host, port)
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await writer.drain()
            await _splice(reader, writer, *upstream, traffic, rate, tunnel=host)
            return
        try:
            parts = urlsplit(target)
        except ValueError:  # an unclosed or bad IPv6 literal
            raise _Refused(400, f"bad URL {target[:200]!r}") from None
        if parts.scheme != "http" or not parts.hostname:
            raise _Refused(400, "the proxy takes CONNECT, or absolute http:// URLs")
        try:
            port = parts.port or 80
        except ValueError:
            raise _Refused(400, f"bad destination {parts.netloc!r}") from None
        host = parts.hostname.lower().rstrip(".")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # The URL names the destination, and its Host header is the URL's host
        # (as HTTP says a proxy does): a Host of the client's choice would reach
        # any virtual host behind an allowed address.
        kept = [(name, value) for name, value in headers
                if name.lower() not in _HOP_BY_HOP and name.lower() != "host"]
        authority = f"[{host}]" if ":" in host else host
        kept.insert(0, ("Host", authority if port == 80 else f"{authority}:{port}"))
        if host == MODEL_HOST:
            # Exactly the model calls: GET and DELETE of /v1/responses/{id} read and
            # forgot the tenant's stored responses (its other users' conversations).
            if method != "POST" or (parts.path or "/") not in _MODEL_PATHS:
                raise _Refused(403, f"{MODEL_HOST} serves the model API only "
                                    f"(POST {', '.join(_MODEL_PATHS)})")
            upstream, kept = await self._to_gateway(grant, kept)
        else:
            kept = _with_secrets(kept, grant, host)
            path = _replace_placeholders(path, grant, host)
            upstream = await self._open_checked(grant, host, port)
        request = [f"{method} {path} HTTP/1.1"] + [f"{name}: {value}" for name, value in kept]
        request.append("Connection: close")
        upstream[1].write(("\r\n".join(request) + "\r\n\r\n").encode("latin-1"))
        traffic.bytes_out += len(head)
        await _splice(reader, writer, *upstream, traffic, rate)

    async def _open_checked(self, grant: Grant, host: str, port: int):
        policy = Narrowed(self._operator, grant.allowed)
        if not policy.allows(host, port):
            raise _Refused(403, f"egress to {host}:{port} is not allowed")
        loop = asyncio.get_running_loop()
        try:
            found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            raise _Refused(502, f"cannot resolve {host}") from None
        except UnicodeError:  # a label the IDNA codec refuses: empty, or over 63 characters
            raise _Refused(400, f"bad host name {host!r}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in found))
        for address in addresses:
            if not policy.allows_address(ipaddress.ip_address(address.split("%")[0]), port):
                raise _Refused(403, f"{host} resolves to {address}, which is not allowed")
        try:
            return await asyncio.wait_for(asyncio.open_connection(addresses[0], port),
                                          _CONNECT_SECONDS)
        except (OSError, asyncio.TimeoutError) as exc:
            raise _Refused(502, f"cannot connect to {host}:{port}: {exc}") from None

    async def _to_gateway(self, grant: Grant, headers: list[tuple[str, str]]):
        if self._gateway is None:
            raise _Refused(503, "this server has no model API for sandboxes")
        token = ""
        kept = []
        for name, value in headers:
            lower = name.lower()
            if lower == "authorization" and value.lower().startswith("bearer "):
                token = value[7:].strip()
            elif lower == "x-api-key":
                token = value.strip()
            elif lower.startswith("x-shoal-") or lower == "authorization":
                continue  # never let the sandbox speak for the broker
            else:
                kept.append((name, value))
        try:
            spent = self._tokens.spend(token, grant.tenant, grant.container_id)
        except TokenRefused as refusal:
            raise _Refused(refusal.status, str(refusal)) from None
        kept += [("x-shoal-internal", self._internal_secret), ("x-shoal-tenant", spent.tenant),
                 ("x-shoal-container", spent.container_id)]
        try:
            return await asyncio.wait_for(asyncio.open_connection(*self._gateway),
                                          _CONNECT_SECONDS), kept
        except (OSError, asyncio.TimeoutError) as exc:
            raise _Refused(502, f"cannot reach the model API: {exc}") from None


def new_socket_dir(run_dir: Path) -> Path:
    """A fresh directory for a broker's socket under ``run_dir``.

    Sandboxes see its host path in their mountinfo, so the name is random (no
    pid). A dead server's directory is recognised by its socket, which nobody
    answers any more, and removed.
    """
    for old in run_dir.glob("egress-*"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            directory = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
            try:
                probe.connect(f"/proc/self/fd/{directory}/proxy.sock")
            finally:
                os.close(directory)
        except ConnectionRefusedError:
            shutil.rmtree(old, ignore_errors=True)  # its server is gone
        except OSError:
            pass  # half made, or another server's that is starting: not ours to judge
        finally:
            probe.close()
    return run_dir / f"egress-{secrets.token_hex(8)}"


# -- helpers ------------------------------------------------------------------------------------
def _peer_uid(sock) -> int | None:
    # struct ucred is {pid_t, uid_t, gid_t}: uid and gid are unsigned, and a
    # sandbox uid past 2**31 read as signed matched no grant.
    try:
        _, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("iII")))
    except (OSError, AttributeError):
        return None
    return uid


def _host_port(target: str, default: int | None) -> tuple[str, int]:
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = target.rpartition(":") if ":" in target else (target, "", "")
    digits = port_text.isascii() and port_text.isdigit()  # not '²', which isdigit() takes
    if not digits and default is None:
        raise _Refused(400, "CONNECT needs host:port")
    port = int(port_text) if digits else default
    if not host or not 0 < port < 65536:
        raise _Refused(400, f"bad destination {target!r}")
    return host.lower().rstrip("."), port


def _with_secrets(headers: list[tuple[str, str]], grant: Grant, host: str):
    return [(name, _replace_placeholders(value, grant, host)) for name, value in headers]


def _replace_placeholders(text: str, grant: Grant, host: str) -> str:
    for placeholder, (domain, value) in grant.secrets.items():
        if placeholder in text and (host == domain or host.endswith("." + domain)):
            text = text.replace(placeholder, value)
    return text


async def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    body = (reason + "\n").encode()
    phrase = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 429: "Too Many Requests",
              431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "Error")
    try:
        writer.write(f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except ConnectionError:
        pass


async def _splice(client_reader, client_writer, upstream_reader, upstream_writer,
                  traffic: Traffic, rate: _Rate, tunnel: str | None = None) -> None:
    """Move bytes both ways until the far side is done. In a tunnel to ``tunnel``
    the client's first flight is checked before it goes (:mod:`.sni`); a refused
    one is answered with TLS's alert, and raised once the tunnel is closed."""
    refused: list[sni.Refused] = []

    async def forward(data: bytes, writer, outbound: bool) -> None:
        if outbound:
            traffic.bytes_out += len(data)
        else:
            traffic.bytes_in += len(data)
        await rate.spend(len(data))
        writer.write(data)
        await writer.drain()

    async def pump(reader, writer, outbound: bool) -> None:
        try:
            if outbound and tunnel is not None:
                if data := await sni.first_flight(reader, tunnel, _CHUNK):
                    await forward(data, writer, outbound)
                else:
                    reader = None  # the client closed at once
            while reader is not None and (data := await reader.read(_CHUNK)):
                await forward(data, writer, outbound)
            if writer.can_write_eof():
                writer.write_eof()
        except sni.Refused as refusal:
            refused.append(refusal)
            client_writer.write(sni.UNRECOGNIZED_NAME_ALERT)
            upstream_writer.close()  # nothing went; the far side's end follows
        except (ConnectionError, OSError):
            pass

    # Once the far side has finished (and said so), the exchange is over: a client
    # that keeps its end open must not hold the connection, and its slot, forever.
    outbound = asyncio.ensure_future(pump(client_reader, upstream_writer, True))
    try:
        await pump(upstream_reader, client_writer, False)
    finally:
        outbound.cancel()
        await asyncio.gather(outbound, return_exceptions=True)
        upstream_writer.close()
    if refused:
        raise refused[0]
