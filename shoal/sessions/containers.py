"""Durable containers: files and metadata that outlive any one sandbox.

A container is the durable thing; a sandbox is attached to it only while it is
used. Sessions and runs acquire a container's sandbox (starting a fresh one on
the container's files if none is live) and release it; once no one has used it
for a while it is shut down, and its files stay. A container whose idle TTL
runs out expires: its sandbox stops and its files are deleted. Deletion is the
same, on request. Both leave the metadata row: reads of the id answer 404, and
only a write that names it again (Zylon's "used, it exists") makes a new, empty
container under the same id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass, field, replace

from shoal.config import Settings
from shoal.sandbox import Sandbox, SandboxPool
from shoal.storage import ContainerRecord, FileStore, MetadataStore

log = logging.getLogger("shoal.containers")

_CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# last_active_at is written through at most this often per container, so a busy
# container costs the database one write per interval, not one per call.
_TOUCH_WRITE_SECONDS = 5.0


class UnknownContainer(LookupError):
    """No active container with that id exists for this tenant."""


class InvalidContainer(ValueError):
    """A container id or setting the client may not use."""


@dataclass(eq=False)
class _Live:
    sandbox: Sandbox
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class ContainerManager:
    def __init__(self, settings: Settings, pool: SandboxPool, metadata: MetadataStore,
                 files: FileStore) -> None:
        self.settings = settings
        self.pool = pool
        self.metadata = metadata
        self.files = files
        self._live: dict[tuple[str, str], _Live] = {}
        self._starting: dict[tuple[str, str], asyncio.Future] = {}
        self._started_here: set[tuple[str, str]] = set()
        self._touch_written: dict[tuple[str, str], float] = {}
        self._records: dict[tuple[str, str], ContainerRecord] = {}
        self._server_started = time.time()

    # -- records --------------------------------------------------------------------
    def _check_minutes(self, minutes: int | None) -> int:
        if minutes is None:
            return self.settings.container_ttl_minutes
        if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= 240:
            raise InvalidContainer("expires_after.minutes must be an integer from 1 to 240")
        return minutes

    async def create(self, tenant: str, container_id: str | None = None, name: str | None = None,
                     minutes: int | None = None, implicit: bool = False,
                     memory_limit: str | None = None) -> ContainerRecord:
        if container_id is None:
            container_id = "cnt_" + secrets.token_hex(12)
        elif not _CLIENT_ID.match(container_id):
            raise InvalidContainer("a container id is 1 to 128 letters, digits, '.', '_', ':' "
                                   "or '-', starting with a letter or digit")
        now = time.time()
        record = ContainerRecord(tenant=tenant, id=container_id, name=name, created_at=now,
                                 last_active_at=now, expires_after_minutes=self._check_minutes(minutes),
                                 implicit=implicit, memory_limit=memory_limit)
        await self.metadata.put_container(record)
        self._records[(tenant, container_id)] = record
        return record

    async def get(self, tenant: str, container_id: str) -> ContainerRecord:
        record = self._records.get((tenant, container_id))
        if record is None:
            record = await self.metadata.get_container(tenant, container_id)
        if record is None or record.status != "active" or record.expires_at <= time.time():
            raise UnknownContainer(f"no container {container_id!r}")
        self._records[(tenant, container_id)] = record
        return record

    async def get_or_create(self, tenant: str, container_id: str) -> ContainerRecord:
        """A client-chosen id names its container: used, it exists (Zylon's model)."""
        try:
            return await self.get(tenant, container_id)
        except UnknownContainer:
            return await self.create(tenant, container_id, implicit=True)

    async def list(self, tenant: str) -> list[ContainerRecord]:
        now = time.time()
        records = await self.metadata.list_containers(tenant)
        return [self._records.get((r.tenant, r.id), r) for r in records if r.expires_at > now]

    async def touch(self, record: ContainerRecord) -> ContainerRecord:
        key = (record.tenant, record.id)
        now = time.time()
        current = self._records.get(key, record).touched(now)
        self._records[key] = current
        if now - self._touch_written.get(key, 0.0) >= _TOUCH_WRITE_SECONDS:
            self._touch_written[key] = now
            await self.metadata.put_container(current)
        return current

    async def delete(self, tenant: str, container_id: str) -> None:
        record = await self.get(tenant, container_id)
        await self._retire(record, "deleted")

    async def _retire(self, record: ContainerRecord, status: str) -> None:
        key = (record.tenant, record.id)
        live = self._live.pop(key, None)
        if live is not None:
            await live.sandbox.close()
        self._records.pop(key, None)
        self._touch_written.pop(key, None)
        await asyncio.to_thread(self.files.destroy, record.tenant, record.id)
        await self.metadata.delete_container_files(record.tenant, record.id)
        await self.metadata.put_container(_with_status(record, status))

    # -- sandboxes --------------------------------------------------------------------
    async def acquire(self, record: ContainerRecord) -> tuple[Sandbox, bool]:
        """The container's live sandbox, started if needed; and whether earlier
        interpreter state was lost (a fresh sandbox on a container used before)."""
        key = (record.tenant, record.id)
        while key in self._starting:
            await asyncio.shield(self._starting[key])
        live = self._live.get(key)
        if live is not None and not live.sandbox.closed:
            live.users += 1
            return live.sandbox, False
        starting = asyncio.get_running_loop().create_future()
        self._starting[key] = starting
        try:
            home = await asyncio.to_thread(self.files.home, record.tenant, record.id)
            sandbox = await self.pool.launch_for(home, record.id[:16])
            self._live[key] = _Live(sandbox, users=1)
        finally:
            del self._starting[key]
            starting.set_result(None)
        # A sandbox ran on these files before (here, or before this server
        # started): whatever its interpreter held is gone now.
        restarted = key in self._started_here or record.created_at < self._server_started
        self._started_here.add(key)
        await self.touch(record)
        return sandbox, restarted

    def release(self, record: ContainerRecord) -> None:
        live = self._live.get((record.tenant, record.id))
        if live is not None:
            live.users = max(0, live.users - 1)
            live.last_used = time.monotonic()

    def files_of(self, record: ContainerRecord):
        """Path-safe access to the container's files, as its live sandbox's uid."""
        live = self._live.get((record.tenant, record.id))
        uid = live.sandbox.uid if live is not None and not live.sandbox.closed else 0
        return self.files.files(record.tenant, record.id, uid)

    # -- reaping ------------------------------------------------------------------------
    async def reap(self) -> None:
        now = time.monotonic()
        idle = [key for key, live in self._live.items()
                if live.users == 0 and now - live.last_used >= self.settings.container_sandbox_idle_seconds]
        for key in idle:
            live = self._live.pop(key)
            log.info("shutting down idle sandbox of container %s", key[1])
            await live.sandbox.close()
            await asyncio.to_thread(self.files.detach, *key)
        for record in await self.metadata.expired_containers(time.time()):
            current = self._records.get((record.tenant, record.id), record)
            if current.expires_at > time.time():
                continue  # touched since the last write-through
            live = self._live.get((record.tenant, record.id))
            if live is not None and live.users:
                continue  # in use: a session's activity keeps it alive
            log.info("container %s expired", record.id)
            await self._retire(current, "expired")

    async def close(self) -> None:
        for key, record in list(self._records.items()):
            await self.metadata.put_container(record)
        lives, self._live = list(self._live.values()), {}
        await asyncio.gather(*(live.sandbox.close() for live in lives), return_exceptions=True)
        await asyncio.to_thread(self.files.close)


def _with_status(record: ContainerRecord, status: str) -> ContainerRecord:
    return replace(record, status=status)
