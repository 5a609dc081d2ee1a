"""Health, Prometheus metrics and one structured log line per request.

``/health`` answers without a token so load balancers can probe it, but says
how busy the server is only to the operator (tenants would learn of each other
from the counts); ``/metrics`` is the operator's too.
The access log is at INFO, so it is silent under the default WARNING level and
costs a request nothing then.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from shoal.sessions import ExecResult

from .auth import bearer_token, is_operator

router = APIRouter()
access_log = logging.getLogger("shoal.access")


class Metrics:
    def __init__(self, manager) -> None:
        self.registry = CollectorRegistry()
        self.exec_seconds = Histogram(
            "shoal_exec_seconds", "Time to run one call, by tool kind", ["tool"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10, 30, 60, 300))
        self.limits_fired = Counter("shoal_limits_fired", "Calls a resource limit stopped or cut",
                                    ["limit"], registry=self.registry)
        sessions = Gauge("shoal_sessions_live", "Sessions leased now", registry=self.registry)
        sessions.set_function(lambda: manager.live)
        ready = Gauge("shoal_pool_ready", "Warm sandboxes ready to lease", registry=self.registry)
        ready.set_function(lambda: manager.pool.ready_count)

    def observe_exec(self, tool: str, result: ExecResult) -> None:
        self.exec_seconds.labels(tool).observe(result.execution_time_ms / 1000)
        for limit in result.limits:
            self.limits_fired.labels(limit.value).inc()


@router.get("/health", summary="Liveness; capacity for the operator")
async def health(request: Request) -> Response:
    manager = request.app.state.manager
    body = {"status": "ok"}
    if is_operator(request):
        body.update(sessions=manager.live, max_sessions=manager.settings.max_sessions,
                    pool_ready=manager.pool.ready_count)
    return Response(json.dumps(body), media_type="application/json")


@router.get("/metrics", summary="Prometheus metrics (the operator's)")
async def metrics(request: Request) -> Response:
    if not is_operator(request):
        table = request.app.state.tokens
        token = bearer_token(request)
        if not token or table.tenant_for(token) is None:
            raise HTTPException(401, "missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
        raise HTTPException(403, "metrics describe every tenant: they need an operator token "
                                 "(SHOAL_OPERATOR_TOKENS)")
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


class AccessLog:
    """ASGI middleware: one JSON line per request, only when INFO is enabled."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def record_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            access_log.info(json.dumps({
                "method": scope["method"], "path": scope["path"], "status": status,
                "ms": round((time.perf_counter() - started) * 1000, 2),
                "tenant": scope.get("state", {}).get("tenant"),
            }))


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIds:
    """ASGI middleware: every request has an id (the client's ``X-Request-Id`` if it
    gave a sane one, else a new one), kept in the request's state for logs and
    error bodies and echoed as ``x-request-id`` (OpenAI's) and ``request-id``
    (Anthropic's)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value.decode("latin-1") for name, value in scope["headers"]
                      if name == b"x-request-id"), "")
        request_id = given if _REQUEST_ID.match(given) else "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id
        header = request_id.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", header),
                                      (b"request-id", header)]
            await send(message)

        await self.app(scope, receive, with_id)


class PathAliases:
    """ASGI middleware: Zylon's clients call Shoal's routes under ``/api/gpt``
    (``/api/gpt/v1/messages``, ``/api/gpt/v1/files``); the prefix is an alias."""

    PREFIX = "/api/gpt"

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PREFIX + "/"):
            raw = scope.get("raw_path")
            scope = {**scope, "path": scope["path"][len(self.PREFIX):]}
            if isinstance(raw, bytes) and raw.startswith(self.PREFIX.encode()):
                scope["raw_path"] = raw[len(self.PREFIX):]
        await self.app(scope, receive, send)
