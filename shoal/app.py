"""Builds the ASGI app: routers, error rendering, and the lifespan that owns
the session manager (and through it the warm pool and the reaper)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from . import __version__
from .api import containers, errors, files, observability, protocol_v1
from .api.auth import TokenTable
from .config import Settings
from .sessions import SessionManager

log = logging.getLogger("shoal")


def create_app(settings: Settings, manager: SessionManager | None = None) -> FastAPI:
    tokens = TokenTable.parse(settings.tokens)
    manager = manager or SessionManager(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await manager.start()
        if not tokens.enabled:
            log.warning("no tokens configured: every client that can reach %s:%s may run code; "
                        "set SHOAL_TOKENS to require bearer tokens", settings.host, settings.port)
        yield
        await manager.close()

    app = FastAPI(title="Shoal", version=__version__, lifespan=lifespan,
                  summary="Isolated, stateful code execution for LLM gateways",
                  docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.manager = manager
    app.state.tokens = tokens
    app.state.metrics = observability.Metrics(manager)
    errors.install(app)
    app.include_router(observability.router)
    app.include_router(protocol_v1.router)
    app.include_router(files.router)
    app.include_router(containers.router)
    app.add_middleware(errors.ShutdownGuard)
    app.add_middleware(observability.AccessLog)
    return app
