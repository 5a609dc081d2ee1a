"""Builds the ASGI app: routers, error rendering, and the lifespan that owns
the session manager (and through it the warm pool and the reaper)."""

from __future__ import annotations

import gc
import logging
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
from fastapi import FastAPI

from . import __version__
from .api import (containers, errors, files, messages, observability, protocol_v1, responses,
                  runs, runtime, threads)
from .api.auth import TokenTable, scope_bearer_token
from .api.body_limits import BodyLimits, Budget
from .api.stalled import StalledResponses
from .config import MiB, Settings
from .gateway import Gateway
from .runs import CALLBACKS_AT_ONCE, RunManager
from .sessions import SessionManager

log = logging.getLogger("shoal")


def create_app(settings: Settings, manager: SessionManager | None = None) -> FastAPI:
    tokens = TokenTable.parse(settings.tokens, settings.operator_tokens)
    manager = manager or SessionManager(settings)
    manager.set_tenants(tokens.tenants)
    run_manager = RunManager(settings, manager)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        _build_routes(app)
        await manager.start()
        await run_manager.start_reaper()
        # Outbound calls the host makes for tools (never for the sandbox): no
        # redirects, so an allowed host cannot bounce a call elsewhere. Room for
        # every session's callbacks at once, so none waits behind another's.
        callbacks = settings.max_sessions * CALLBACKS_AT_ONCE
        app.state.http_client = httpx.AsyncClient(
            follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_connections=callbacks,
                                max_keepalive_connections=min(20, callbacks)))
        # The models' own pool: tool callbacks never wait behind model calls,
        # and its size is the operator's (each tenant's share is capped apart).
        app.state.upstream_client = httpx.AsyncClient(
            follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_connections=settings.upstream_max_connections,
                                max_keepalive_connections=min(64, settings.upstream_max_connections)))
        app.state.gateway = Gateway(settings, manager, run_manager, app.state.upstream_client,
                                    tokens.tenants)
        await app.state.gateway.start()
        reservations = getattr(app.state, "reservations", None)
        if reservations is not None:
            await reservations.start()
        # Everything built so far (the app, its routes, the imported libraries)
        # lives as long as the process: out of the collector's sight, a full
        # collection walks what requests made, not the whole heap (a 45 ms pause).
        gc.freeze()
        if not tokens.enabled:
            # The address bound (serve sets it: a port of 0 is the kernel's choice).
            address = getattr(app.state, "url", None) or f"http://{settings.host}:{settings.port}"
            log.warning("no tokens configured: every client that can reach %s may run code; "
                        "set SHOAL_TOKENS to require bearer tokens", address)
        yield
        # Closed from the last pushed to the first, each even if one before it
        # failed. Reservations close after the sandboxes: while the host stops
        # them (a drain snapshots them), its slots stay reserved, so Ray places
        # nothing new here.
        async with AsyncExitStack() as closing:
            closing.push_async_callback(app.state.http_client.aclose)
            closing.push_async_callback(app.state.upstream_client.aclose)
            if reservations is not None:
                closing.push_async_callback(reservations.close)
            closing.push_async_callback(manager.close)
            closing.push_async_callback(run_manager.close)
            closing.push_async_callback(app.state.gateway.close)

    app = FastAPI(title="Shoal", version=__version__, lifespan=lifespan,
                  summary="Isolated, stateful code execution for LLM gateways",
                  docs_url="/docs", redoc_url=None)
    app.state.settings = settings
    app.state.manager = manager
    app.state.runs = run_manager
    app.state.tokens = tokens
    app.state.draining = False
    app.state.cutting = False
    app.state.metrics = observability.Metrics(manager, tokens.tenant_names,
                                              lambda: app.state.draining)
    errors.install(app)
    app.include_router(observability.router)
    app.include_router(protocol_v1.router)
    app.include_router(files.router)
    app.include_router(containers.router)
    app.include_router(runs.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    app.include_router(runtime.router)
    app.include_router(threads.router)
    # Outermost last: Edge sees every answer, the budget's refusals included.
    buffer = settings.request_buffer_mib * MiB
    # With one tenant there is no one else's room to keep: its bodies may fill it all.
    share = max(settings.request_cap, buffer // 2) if tokens.tenants > 1 else buffer
    app.add_middleware(BodyLimits, cap=settings.request_cap, budget=Budget(buffer, share),
                       idle_seconds=settings.request_body_idle_seconds,
                       share_of=lambda scope: tokens.tenant_for(scope_bearer_token(scope)))
    app.add_middleware(StalledResponses, seconds=settings.response_stall_seconds)
    app.add_middleware(observability.Edge)
    reservations = _reservations(app, settings, manager)
    if reservations is not None:
        from .cluster.slots import AdoptProbes
        app.add_middleware(AdoptProbes, reservations=reservations)
    return app


def _build_routes(app: FastAPI) -> None:
    """Have FastAPI build every router's routes now, not on first use.

    FastAPI builds an included router's routes (a pydantic adapter for each
    parameter of each route) when the first request reaches that router: some
    80 ms, paid by whichever clients come first after a start, the readiness
    probe excepted. Matching a path no route has walks, and so builds, them all.
    """
    scope = {"type": "http", "method": "GET", "path": "/.shoal/build-routes", "root_path": "",
             "headers": [], "query_string": b""}
    for route in app.router.routes:
        route.matches(dict(scope))


def _reservations(app: FastAPI, settings: Settings, manager: SessionManager):
    """A sandbox host of a cluster keeps Ray's view of its room true
    (shoal.cluster.slots): Ray places what is new by it."""
    if not (settings.node_key and settings.node_id and settings.ray_address):
        return None
    from .cluster.host import NAMESPACE
    from .cluster.slots import Reservations, Room

    each = settings.memory_limit_mib * MiB

    def room() -> Room:
        reasons = observability.readiness(manager, app.state.draining)
        available = observability.memory_available()
        return Room(held=manager.live + manager.reserved, max_sessions=settings.max_sessions,
                    blocked=any(code != "at_capacity" for code, _ in reasons),
                    memory_room=available // each if available is not None else None)

    reservations = Reservations(settings.ray_address, settings.node_id, NAMESPACE, room)
    app.state.reservations = reservations
    # Expired containers whose host left the cluster are reaped by the others.
    manager.containers.hosts_gone = reservations.hosts_gone
    return reservations
