"""Probes, Prometheus metrics, and the edge every request passes through.

The probes answer without a token, because load balancers and kubelets have
none:

- ``/livez``: the process serves (the event loop turns).
- ``/readyz``: a session can be created now. It fails with the reasons
  (``draining``, ``at_capacity``, ``uids_exhausted``, ``pool_cannot_warm``,
  ``disk_low``) and ``Retry-After``.
- ``/health``: the protocol's check. It is always 200, with ``"status": "ok"``
  or ``"degraded"`` and the same reasons.

The details (counts, the last launch error) are the operator's. A tenant
would learn of the others from them. ``/metrics`` is the operator's too: the
series cover every tenant.

:class:`Edge` is the one ASGI middleware. It does in one pass what a request
needs around the app: Zylon's ``/api/gpt`` alias, the request id (the client's
``X-Request-Id`` if sane, else a new one, echoed and put in every log line of
the request), ``Retry-After`` on answers cut by shutdown, the access log line,
the HTTP metrics, and one log line and a 500 in the dialect's shape for an
error nothing else handled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shoal.config import MiB
from shoal.logs import request_context
from shoal.sessions import ExecResult

from .auth import bearer_token, is_operator
from .errors import error_response
from .schemas import METRICS_ERRORS, PROMETHEUS, Health, Liveness, NotReady, Ready

router = APIRouter()
disable_created_metrics()  # the *_created series only double what a scrape holds
access_log = logging.getLogger("shoal.access")
log = logging.getLogger("shoal.api")

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                    5, 10, 30, 60, 300)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Metrics:
    def __init__(self, manager, tenants: frozenset[str], draining) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "shoal_http_requests", "HTTP requests answered, by route template and status",
            ["method", "route", "status"], registry=self.registry)
        self.http_seconds = Histogram(
            "shoal_http_request_seconds", "Time to answer an HTTP request (to its last byte)",
            ["method", "route"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.exec_seconds = Histogram(
            "shoal_exec_seconds", "Time to run one call, by tool kind", ["tool"],
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.limits_fired = Counter("shoal_limits_fired", "Calls a resource limit stopped or cut",
                                    ["limit"], registry=self.registry)
        self.registry.register(_LiveCollector(manager, tenants, draining))

    def observe_exec(self, tool: str, result: ExecResult) -> None:
        self.exec_seconds.labels(tool).observe(result.execution_time_ms / 1000)
        for limit in result.limits:
            self.limits_fired.labels(limit.value).inc()

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "OTHER"
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(seconds)


class _LiveCollector:
    """Series read from the layers below at scrape time, never copied into
    gauges on the request path."""

    def __init__(self, manager, tenants: frozenset[str], draining) -> None:
        self.manager = manager
        self.draining = draining
        # The only tenant label values: the token table's tenants. Anything
        # else is counted as "other", so no request can mint a series.
        self.tenants = tenants

    def describe(self):
        return []

    def collect(self):
        manager = self.manager
        pool = manager.pool
        stats = pool.stats
        for name, text, value in (
                ("shoal_sandbox_launches", "Sandboxes started", stats.launches),
                ("shoal_sandbox_launch_failures", "Sandbox starts that failed",
                 stats.launch_failures),
                ("shoal_sandbox_crashes", "Sandboxes whose processes died under a call "
                                          "(not a memory kill)", stats.crashes),
                ("shoal_sandbox_oom_kills", "Processes the kernel killed for a sandbox's "
                                            "memory limit", stats.oom_kills),
                ("shoal_sandbox_restarts", "Sandboxes restarted on the same files",
                 stats.restarts),
                ("shoal_zygote_restarts", "Zygotes started again after theirs died "
                                          "(its sandboxes' next calls restart them)",
                 stats.zygote_restarts)):
            yield CounterMetricFamily(name, text, value=value)
        for name, text, value in (
                ("shoal_sessions_live", "Sessions leased now", manager.live),
                ("shoal_sessions_max", "Sessions this server may hold",
                 manager.settings.max_sessions),
                ("shoal_pool_ready", "Warm sandboxes ready to lease", pool.ready_count),
                ("shoal_pool_target", "Warm sandboxes the pool aims to keep", pool.target),
                ("shoal_uids_free", "Sandbox uids this server does not hold", pool.free_uids),
                ("shoal_ready", "1 when a session can be created now",
                 0 if readiness(manager, self.draining()) else 1)):
            yield GaugeMetricFamily(name, text, value=value)
        containers, disk = manager.containers.usage()
        yield GaugeMetricFamily("shoal_containers_active", "Durable containers with files",
                                value=containers)
        yield GaugeMetricFamily("shoal_container_disk_bytes", "Disk the containers' volumes "
                                "really use (their images are sparse)", value=disk)
        sessions = GaugeMetricFamily("shoal_tenant_sessions", "Sessions and runs one tenant "
                                     "holds now", labels=["tenant"])
        seconds = CounterMetricFamily("shoal_tenant_exec_seconds", "Seconds code of one "
                                      "tenant ran in sandboxes", labels=["tenant"])
        calls = CounterMetricFamily("shoal_tenant_calls", "Calls one tenant ran in sandboxes",
                                    labels=["tenant"])
        held: dict[str, float] = {}
        for tenant, count in manager.holdings().items():
            key = tenant if tenant in self.tenants else "other"
            held[key] = held.get(key, 0) + count
        ran: dict[str, list[float]] = {}
        for tenant, spent in list(stats.exec_seconds.items()):
            key = tenant if tenant in self.tenants else "other"
            totals = ran.setdefault(key, [0.0, 0])
            totals[0] += spent
            totals[1] += stats.calls.get(tenant, 0)
        for tenant in sorted(self.tenants | held.keys() | ran.keys()):
            sessions.add_metric([tenant], held.get(tenant, 0))
            spent, count = ran.get(tenant, (0.0, 0))
            seconds.add_metric([tenant], spent)
            calls.add_metric([tenant], count)
        yield sessions
        yield seconds
        yield calls
        yield from self._egress()

    def _egress(self):
        broker = self.manager.egress
        if broker is None:
            return
        # Per container while one of its sandboxes lives: bounded by max_sessions.
        live = broker.live_scopes(self.manager.pool.live_sandboxes())
        moved = CounterMetricFamily("shoal_egress_bytes", "Bytes through the egress proxy, "
                                    "by container and direction", labels=["container", "direction"])
        opened = CounterMetricFamily("shoal_egress_connections", "Proxy connections a "
                                     "container's sandboxes opened", labels=["container"])
        refused = CounterMetricFamily("shoal_egress_refused", "Proxy requests the policy "
                                      "refused", labels=["container"])
        for scope, traffic in broker.traffic_of(live):
            moved.add_metric([scope, "out"], traffic.bytes_out)
            moved.add_metric([scope, "in"], traffic.bytes_in)
            opened.add_metric([scope], traffic.connections)
            refused.add_metric([scope], traffic.refused)
        yield moved
        yield opened
        yield refused
        yield GaugeMetricFamily("shoal_egress_open_connections", "Proxy connections open now, "
                                "all sandboxes together", value=broker.open_connections)


def readiness(manager, draining: bool) -> list[tuple[str, str]]:
    """Why a session could not be created now, as (code, detail); empty when it could."""
    found = []
    if draining:
        found.append(("draining", "the server is shutting down"))
    if manager.live + manager.reserved >= manager.settings.max_sessions:
        found.append(("at_capacity", f"all {manager.settings.max_sessions} session slots "
                                     "are taken"))
    codes = {"uids exhausted": "uids_exhausted", "pool cannot warm": "pool_cannot_warm",
             "disk low": "disk_low"}
    for problem in manager.pool.problems():
        prefix = problem.split(":", 1)[0]
        found.append((codes.get(prefix, "degraded"), problem))
    return found


def _reasons(request: Request) -> tuple[list[tuple[str, str]], bool]:
    state = request.app.state
    return readiness(state.manager, getattr(state, "draining", False)), is_operator(request)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers=headers)


@router.get("/livez", summary="Liveness: the process serves",
            responses={200: {"model": Liveness, "description": "The process serves"}})
async def livez() -> Response:
    return _json({"status": "ok"})


@router.get("/readyz", summary="Readiness: a session can be created now",
            responses={200: {"model": Ready, "description": "A session can be created now"},
                       503: {"model": NotReady, "description": "Not ready; the reasons say why"}})
async def readyz(request: Request) -> Response:
    reasons, operator = _reasons(request)
    if not reasons:
        return _json({"status": "ready"})
    body = {"status": "not_ready", "reasons": [code for code, _ in reasons]}
    if operator:
        body["details"] = [detail for _, detail in reasons]
    return _json(body, 503, {"Retry-After": "1"})


@router.get("/health", summary="Health; capacity for the operator",
            responses={200: {"model": Health, "description": "Always 200: ok or degraded"}})
async def health(request: Request) -> Response:
    manager = request.app.state.manager
    reasons, operator = _reasons(request)
    body: dict = {"status": "degraded" if reasons else "ok"}
    if reasons:
        body["reasons"] = [code for code, _ in reasons]
    if operator:
        body.update(sessions=manager.live, max_sessions=manager.settings.max_sessions,
                    pool_ready=manager.pool.ready_count, pool_target=manager.pool.target,
                    uids_free=manager.pool.free_uids, launcher=manager.pool.launcher,
                    memory_available_bytes=memory_available(),
                    sandbox_memory_bytes=manager.settings.memory_limit_mib * MiB)
        if reasons:
            body["details"] = [detail for _, detail in reasons]
    return _json(body)


def memory_available() -> int | None:
    """The kernel's estimate of memory a new process could use without swapping."""
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@router.get("/metrics", summary="Prometheus metrics (the operator's)", response_class=Response,
            responses={**METRICS_ERRORS,
                       200: {"content": PROMETHEUS, "description": "Every series, every tenant"}},
            openapi_extra={"security": [{"HTTPBearer": []}]})
async def metrics(request: Request) -> Response:
    if not is_operator(request):
        table = request.app.state.tokens
        token = bearer_token(request)
        if not token or table.tenant_for(token) is None:
            raise HTTPException(401, "missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
        raise HTTPException(403, "metrics describe every tenant: they need an operator token "
                                 "(SHOAL_OPERATOR_TOKENS)")
    body = await asyncio.to_thread(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ALIAS_PREFIX = "/api/gpt"  # Zylon's clients call Shoal's routes under it
_ALIAS_BYTES = ALIAS_PREFIX.encode()


def request_id_from(headers) -> str:
    """The client's X-Request-Id where it is one we keep, else a new id."""
    given = ""
    for name, value in headers:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            break
    return given if _REQUEST_ID.match(given) else "req_" + secrets.token_hex(12)


class Edge:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith(ALIAS_PREFIX + "/"):
            scope["path"] = path[len(ALIAS_PREFIX):]
            raw = scope.get("raw_path")
            if isinstance(raw, bytes) and raw.startswith(_ALIAS_BYTES):
                scope["raw_path"] = raw[len(_ALIAS_BYTES):]
        request_id = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id
        context = {"request_id": request_id}
        reset = request_context.set(context)
        state = scope["app"].state
        header = request_id.encode()
        started = time.perf_counter()
        status = 0

        async def edge_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", header),
                           (b"request-id", header)]
                if getattr(state, "cutting", False) and not any(
                        name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", b"1"))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, edge_send)
        except asyncio.CancelledError:
            if status:
                raise
            # uvicorn cancelled the call after the shutdown's last grace: it still
            # gets an answer in its dialect, not a hang-up.
            response = error_response(Request(scope), 503,
                                      "the server is shutting down; the call was stopped")
            await response(scope, receive, edge_send)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if not status:
                await error_response(Request(scope), 500, "internal error")(scope, receive,
                                                                              edge_send)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            state.metrics.observe_http(scope["method"], template, status or 500, elapsed)
            if access_log.isEnabledFor(logging.INFO):
                access_log.info("request", extra={
                    "method": scope["method"], "path": scope["path"], "route": template,
                    "status": status or 500, "ms": round(elapsed * 1000, 2),
                    "client": (scope.get("client") or ("?",))[0]})
            request_context.reset(reset)
