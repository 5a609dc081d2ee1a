"""Session lifecycle: lease and release, lifetimes, the reaper, capacity, tenancy.

Ids are 128 random bits, so they cannot be guessed; a tenant asking for a
session that belongs to another tenant is told it does not exist, exactly as
for an id that never existed, so ids leak nothing across tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time

from shoal.config import MiB, Settings, read_secret
from shoal.egress.broker import EgressBroker, Grant, new_socket_dir
from shoal.egress.policy import Allowlist
from shoal.egress.tokens import ModelTokens
from shoal.sandbox import Sandbox, SandboxPool
from shoal.storage import open_files, open_metadata

from . import network

from .container_files import ContainerFiles
from .containers import ContainerManager, TenantQuotaExceeded, UnknownContainer
from .uploads import Uploads
from .session import Session

log = logging.getLogger("shoal.sessions")


class UnknownSession(LookupError):
    """No session with that id exists for this tenant."""


class AtCapacity(RuntimeError):
    """Every session slot is taken."""


class Slot:
    """A run's hold on a live-sandbox slot: one of its tenant's share, and one of
    the server's. The share may be given back first (``leave_share``): a run
    whose stream has ended is over for its tenant, who may start the next one,
    while its sandbox, still closing, counts against the server's slots until
    the slot is called."""

    __slots__ = ("_manager", "_tenant", "_shared", "_held")

    def __init__(self, manager: SessionManager, tenant: str) -> None:
        self._manager = manager
        self._tenant = tenant
        self._shared = self._held = True

    def leave_share(self) -> None:
        if self._shared:
            self._shared = False
            self._manager._unhold(self._tenant)

    def __call__(self) -> None:
        self.leave_share()
        if self._held:
            self._held = False
            self._manager._reserved -= 1


class SessionManager:
    def __init__(self, settings: Settings, pool: SandboxPool | None = None) -> None:
        self.settings = settings
        self.pool = pool or SandboxPool(settings)
        self.metadata = open_metadata(settings.data_dir, read_secret(settings.database_url))
        self.files = open_files(settings.data_dir, settings.run_dir, settings.disk_limit_mib * MiB,
                                settings.max_file_bytes, settings.object_store_config())
        self.containers = ContainerManager(settings, self.pool, self.metadata, self.files)
        self.containers.on_retire = self._end_sessions_of
        self.container_files = ContainerFiles(self.containers, self.metadata)
        self.uploads = Uploads(self.metadata, self.files, settings.tenant_max_upload_bytes,
                               settings.tenant_max_upload_files)
        self._sessions: dict[str, Session] = {}
        self._reserved = 0
        self._held: dict[str, int] = {}  # slots per tenant: its sessions and runs
        # Fair share: how many of the slots one tenant may hold (set by the app,
        # which knows how many tenants its tokens name).
        self.tenant_cap = settings.tenant_max_sessions or settings.max_sessions
        self._reaper: asyncio.Task | None = None
        # Egress: the broker (where granted), the model tokens it checks, and the
        # secret by which the gateway knows a request the broker forwarded.
        self.egress: EgressBroker | None = None
        self.model_tokens = ModelTokens(settings.model_token_seconds, settings.model_token_requests)
        self.internal_secret = secrets.token_urlsafe(32)

    async def start(self) -> None:
        await self.metadata.open()
        if self.settings.egress_enabled:
            host = self.settings.host if self.settings.host not in ("0.0.0.0", "::", "") \
                else "127.0.0.1"
            self.egress = EgressBroker(
                new_socket_dir(self.settings.run_dir),
                Allowlist(self.settings.egress_allow), self._lease_of_uid, self.model_tokens,
                (host, self.settings.port) if self.settings.model_upstream else None,
                self.internal_secret, self.settings.egress_max_connections,
                self.settings.egress_bytes_per_second)
            await self.egress.start()
            self.pool.egress_dir = self.egress.socket_dir
        await self.pool.start()
        self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(self._detach(s) for s in sessions), return_exceptions=True)
        await self.containers.close()
        await self.pool.close()
        if self.egress is not None:
            await self.egress.close()
        await self.metadata.close()

    def grant_egress(self, sandbox, tenant: str, container, scope: str,
                     env: dict[str, str] | None = None) -> None:
        """What ``sandbox`` may reach while it works for ``tenant`` (and ``container``),
        and the environment its calls get (domain secrets' placeholders, ``env``)."""
        grant, secret_env = network.grant(tenant, container, scope)
        sandbox.egress_grant = grant if self.egress is not None else None
        sandbox.call_env = {**secret_env, **(env or {})} if self.egress is not None else {}

    def _lease_of_uid(self, uid: int) -> tuple[Sandbox, Grant | None] | None:
        sandbox = self.pool.sandbox_of_uid(uid)
        return (sandbox, getattr(sandbox, "egress_grant", None)) if sandbox is not None else None

    async def cut_all(self, reason: str) -> int:
        """Stop every running call, sessions' and runs' alike (see SandboxPool.cut_all)."""
        return await self.pool.cut_all(reason)

    @property
    def reserved(self) -> int:
        """Slots claimed by leases still starting and by runs."""
        return self._reserved

    def holdings(self) -> dict[str, int]:
        """Slots (sessions and runs) each tenant holds now."""
        return dict(self._held)

    @property
    def live(self) -> int:
        return len(self._sessions)

    def held_by(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def set_tenants(self, count: int) -> None:
        """How many tenants can exist: with more than one, none takes every slot."""
        settings = self.settings
        if settings.tenant_max_sessions:
            self.tenant_cap = settings.tenant_max_sessions
        elif count > 1:
            self.tenant_cap = max(1, settings.max_sessions // 2)
        else:
            self.tenant_cap = settings.max_sessions

    def _claim_slot(self, tenant: str) -> None:
        settings = self.settings
        # A full house first: where the tenant's share is every slot, it is the
        # server that is full, and waiting (503) is what helps.
        if len(self._sessions) + self._reserved >= settings.max_sessions:
            raise AtCapacity(f"all {settings.max_sessions} session slots are in use; "
                             "retry after a session is released")
        held = self._held.get(tenant, 0)
        if held >= self.tenant_cap:
            raise TenantQuotaExceeded(f"this tenant holds {held} sessions and runs, its share of "
                                      "this server; release one and retry")
        self._reserved += 1
        self._held[tenant] = held + 1

    def _unhold(self, tenant: str) -> None:
        left = self._held.get(tenant, 1) - 1
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def claim_slot(self, tenant: str) -> Slot:
        """Hold one of the live-sandbox slots (a run) until the returned slot is
        called; AtCapacity if none is free, TenantQuotaExceeded past the tenant's share."""
        self._claim_slot(tenant)
        return Slot(self, tenant)

    def clamp(self, requested: int | None, default: int, ceiling: int) -> int:
        """A lifetime hint may be lowered to our ceiling, never raised above the hint."""
        if requested is None:
            return min(default, ceiling)
        return min(requested, ceiling)

    async def create(self, tenant: str, idle_timeout_seconds: int | None = None,
                     max_lifetime_seconds: int | None = None, image: str | None = None,
                     container_id: str | None = None) -> Session:
        """Lease a session; with ``container_id``, attached to that durable container
        (created if the id is new), else on an ephemeral sandbox of its own."""
        settings = self.settings
        self._claim_slot(tenant)
        container = None
        restarted = False
        try:
            if container_id is None:
                sandbox = await self.pool.lease()
            else:
                container = await self.containers.get_or_create(tenant, container_id)
                sandbox, restarted = await self.containers.acquire(container)
        except BaseException:
            self._unhold(tenant)
            raise
        finally:
            self._reserved -= 1  # from here the session itself holds the slot
        session = Session(
            id=settings.node_key + secrets.token_hex(16),  # the host's key routes it
            tenant=tenant,
            sandbox=sandbox,
            idle_timeout_seconds=self.clamp(idle_timeout_seconds, settings.idle_timeout_seconds,
                                            settings.max_idle_timeout_seconds),
            max_lifetime_seconds=self.clamp(max_lifetime_seconds, settings.max_lifetime_seconds,
                                            settings.max_lifetime_ceiling_seconds),
            image=image,
            container=container,
            interpreter_restarted=restarted,
            on_activity=self._container_activity if container is not None else None,
        )
        sandbox.owner = {"tenant": tenant, "session": session.id,
                         **({"container": container.id} if container is not None else {})}
        self.grant_egress(sandbox, tenant, container,
                          container.id if container is not None else f"session:{session.id}")
        self._sessions[session.id] = session
        return session

    async def _container_activity(self, session: Session) -> None:
        assert session.container is not None
        session.container = await self.containers.touch(session.container)

    def get(self, tenant: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise UnknownSession(f"no session {session_id!r}")
        return session

    @contextlib.asynccontextmanager
    async def using_files(self, session: Session):
        """Work on the session's files: UnknownSession if it ended since it was
        looked up (a slow upload's body may take a while). A container's deletion
        waits for this work, then ends the session."""
        async with contextlib.AsyncExitStack() as stack:
            if session.container is not None:
                try:
                    await stack.enter_async_context(self.containers.using(session.container))
                except UnknownContainer:
                    raise UnknownSession(f"no session {session.id!r}") from None
            if self._sessions.get(session.id) is not session:
                raise UnknownSession(f"no session {session.id!r}")
            yield

    def _end_sessions_of(self, tenant: str, container_id: str) -> None:
        """A container is being retired: its sessions end now, as if released (404
        from here on, their slots free); its sandbox is stopped next."""
        for session in [s for s in self._sessions.values() if s.tenant == tenant
                        and s.container is not None and s.container.id == container_id]:
            log.info("ending session %s: its container %s is retired", session.id, container_id)
            del self._sessions[session.id]
            self._unhold(session.tenant)
            self.containers.release(session.container)

    async def destroy(self, tenant: str, session_id: str) -> bool:
        """Release a session; ``False`` if there was none (already the desired state)."""
        try:
            session = self.get(tenant, session_id)
        except UnknownSession:
            return False
        await self._release(session)
        return True

    async def _release(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            self._unhold(session.tenant)
            await self._detach(session)

    async def _detach(self, session: Session) -> None:
        if session.container is None:
            await session.sandbox.close()
        else:
            self.containers.release(session.container)

    async def reap(self) -> int:
        now = time.time()
        expired = [s for s in self._sessions.values() if s.expired(now)]
        for session in expired:
            log.info("reaping session %s (tenant %s)", session.id, session.tenant)
            await self._release(session)
        return len(expired)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_seconds)
            try:
                await self.reap()
                await self.containers.reap()
            except Exception:
                log.exception("reaper failed; retrying next interval")
