"""Durable containers: files and metadata that outlive any one sandbox.

A container is the durable thing; a sandbox is attached to it only while it is
used. Sessions and runs acquire a container's sandbox (starting a fresh one on
the container's files if none is live) and release it; once no one has used it
for a while it is shut down, and its files stay. A container whose idle TTL
runs out expires: its sandbox stops and its files are deleted. Deletion is the
same, on request. Both leave the metadata row: reads of the id answer 404, and
only a write that names it again (Zylon's "used, it exists") makes a new, empty
container under the same id.

Retirement and the work done on a container's files never overlap. Each such
piece of work (a Files API read or write, a sandbox starting on the files)
runs inside :meth:`ContainerManager.using`, which refuses a container that is
gone or going; retirement waits for those under way, then ends the container's
sessions (``on_retire``) and stops its sandbox, cutting off a call running in
it: a deletion does not wait minutes for code. Only then are the files
deleted, so nothing written after that point can bring them back: a volume
is made only inside ``using``, for a container that exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from shoal.config import Settings
from shoal.sandbox import Sandbox, SandboxPool
from shoal.storage import (ContainerRecord, FileStore, MetadataStore, StoreUnavailable,
                           VolumeMissing)

log = logging.getLogger("shoal.containers")

_CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# last_active_at is written through at most this often per container, so a busy
# container costs the database one write per interval, not one per call.
_TOUCH_WRITE_SECONDS = 5.0
# Local copies of containers looked at per reaper round for whether this host
# still holds them: a few database lookups per round, however many there are.
_STALE_COPIES_PER_ROUND = 8


# A retired container's row answers 404 as a missing one does; kept a day (a
# front end still holding the container learns of it), then removed: a client
# that creates and deletes containers in a loop added rows without end.
RETIRED_ROWS_KEPT_SECONDS = 86400.0
_FORGET_RETIRED_EVERY_SECONDS = 60.0

class UnknownContainer(LookupError):
    """No active container with that id exists for this tenant."""


class ContainerExists(RuntimeError):
    """A container of that id was created first (by another request or front end)."""


class InvalidContainer(ValueError):
    """A container id or setting the client may not use."""


class TenantQuotaExceeded(RuntimeError):
    """A tenant asked for more than its share (a 429: others keep theirs)."""


class ContainerElsewhere(RuntimeError):
    """Cluster mode: another sandbox host holds the container (the front end that
    sent the request retries there)."""

    def __init__(self, host: str) -> None:
        super().__init__(f"the container is held by sandbox host {host}")
        self.host = host


class UnknownSkill(InvalidContainer):
    """A skill the request names is not in the operator's skills directory."""


MEMORY_TIERS_MIB = {"1g": 1024, "4g": 4096, "16g": 16384, "64g": 65536}
_SKILL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# What the skills of one container may add up to: they are copied onto its volume.
_SKILLS_MAX_BYTES = 64 * 1024 * 1024
_SKILLS_MARKER = ".shoal-skills"


@dataclass(eq=False)
class _Live:
    sandbox: Sandbox
    users: int = 0
    created_at: float = 0.0  # the generation of the container it serves
    last_used: float = field(default_factory=time.monotonic)
    checkpointed: float = 0.0  # when its files were last snapshotted (cluster mode)


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
        self._forgot_retired_at = 0.0  # monotonic: the last purge of retired rows
        self._touch_written: dict[tuple[str, str], float] = {}
        self._records: dict[tuple[str, str], ContainerRecord] = {}
        self._creating: dict[tuple[str, str], asyncio.Lock] = {}
        self._held: set[tuple[str, str]] = set()  # placed on this host (cluster mode)
        self._stale_cursor = 0  # where the next round of _drop_stale_copies starts
        self._orphans_cursor = 0  # and of _reap_orphans
        self._server_started = time.time()
        # Work on containers' files under way (see using()), and the containers
        # being retired, which no new work may start on.
        self._users: dict[tuple[str, str], int] = {}
        self._idle: dict[tuple[str, str], asyncio.Event] = {}
        self._retiring: set[tuple[str, str]] = set()
        # Called with (tenant, container id) as a container is retired, or found
        # retired or moved elsewhere, before its sandbox here stops: the session
        # manager ends the sessions attached to it.
        self.on_retire: Callable[[str, str], None] = lambda tenant, container_id: None
        # Cluster mode, set where the cluster can be asked (a sandbox host on Ray):
        # of the sandbox hosts named, those whose node left the cluster.
        self.hosts_gone: Callable[[set[str]], Awaitable[set[str]]] | None = None

    # -- records --------------------------------------------------------------------
    def _check_minutes(self, minutes: int | None) -> int:
        if minutes is None:
            return self.settings.container_ttl_minutes
        if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= 240:
            raise InvalidContainer("expires_after.minutes must be an integer from 1 to 240")
        return minutes

    def check_memory_limit(self, memory_limit: object) -> str | None:
        """A memory tier this server grants, or InvalidContainer saying why not."""
        if memory_limit is None:
            return None
        if not isinstance(memory_limit, str) or memory_limit not in MEMORY_TIERS_MIB:
            raise InvalidContainer("memory_limit must be one of 1g, 4g, 16g, 64g")
        if MEMORY_TIERS_MIB[memory_limit] > self.settings.max_memory_limit_mib:
            raise InvalidContainer(f"memory_limit {memory_limit} is above this server's ceiling "
                                   f"of {self.settings.max_memory_limit_mib} MiB")
        return memory_limit

    async def create(self, tenant: str, container_id: str | None = None, name: str | None = None,
                     minutes: int | None = None, implicit: bool = False,
                     memory_limit: str | None = None,
                     network_policy: str | None = None) -> ContainerRecord:
        memory_limit = self.check_memory_limit(memory_limit)
        active = [r for r in await self.metadata.list_containers(tenant) if r.expires_at > time.time()]
        if len(active) >= self.settings.tenant_max_containers:
            raise TenantQuotaExceeded(
                f"this tenant already has {len(active)} active containers, its quota; delete "
                "one (or let one expire) before creating another")
        if container_id is None:
            container_id = "cnt_" + secrets.token_hex(12)
        elif not _CLIENT_ID.match(container_id):
            raise InvalidContainer("a container id is 1 to 128 letters, digits, '.', '_', ':' "
                                   "or '-', starting with a letter or digit")
        key = (tenant, container_id)
        async with self._id_lock(key):  # one check-retire-insert per id at a time, here
            now = time.time()
            # A client's id may name a container that expired and was not
            # reaped yet: it goes first, so the new one starts empty.
            old = await self.metadata.get_container(tenant, container_id)
            if old is not None and old.status == "active":
                old = self.current(old)
                live = self._live.get(key)
                if live is not None and live.users and not live.sandbox.closed:
                    # A call still runs in it: in use is not expired.
                    await self.touch(old)
                    raise ContainerExists(f"a container {container_id!r} exists already")
                if old.expires_at <= now:
                    await self._retire_locked(old, "expired")
            elif old is not None:
                # Deleted or expired before: files a retirement cut short (a
                # crash between its two steps) must not become the new one's.
                await asyncio.to_thread(self.files.destroy, tenant, container_id)
            record = ContainerRecord(
                tenant=tenant, id=container_id, name=name, created_at=now, last_active_at=now,
                expires_after_minutes=self._check_minutes(minutes), implicit=implicit,
                memory_limit=memory_limit, network_policy=network_policy)
            # Insert-if-absent: of two front ends creating the same id, one
            # makes it; the other is told it exists.
            if not await self.metadata.create_container(record):
                self._records.pop(key, None)  # whatever is cached here is stale
                raise ContainerExists(f"a container {container_id!r} exists already")
            self._records[key] = record
        await self._hold(tenant, container_id)
        return record

    async def get(self, tenant: str, container_id: str) -> ContainerRecord:
        if (tenant, container_id) in self._retiring:
            raise UnknownContainer(f"no container {container_id!r}")  # being deleted
        record = self._records.get((tenant, container_id))
        if (record is None or record.status != "active" or record.expires_at <= time.time()
                or self.metadata.shared):
            # Not known here, or gone by what is known here, or other front ends
            # may have deleted it or made the id anew since: the store says.
            stored = await self.metadata.get_container(tenant, container_id)
            if (record is not None and stored is not None and stored.status == "active"
                    and stored.created_at == record.created_at
                    and record.last_active_at > stored.last_active_at):
                # The same container: what this front end knows of its last use
                # (written through at most every few seconds) is kept.
                stored = stored.touched(record.last_active_at)
            record = stored
        if record is None or record.status != "active" or record.expires_at <= time.time():
            raise UnknownContainer(f"no container {container_id!r}")
        self._records[(tenant, container_id)] = record
        await self._hold(tenant, container_id)
        return record

    async def _still_held(self, key: tuple[str, str]) -> bool:
        """Cluster mode: whether this host still holds the container. A front end
        moves a container only off a host the cluster reported gone; a host that
        finds it was moved (it was cut off, and came back) must not write its
        copy over the holder's snapshot: its copy is dropped instead."""
        host = self.settings.node_key
        if not host:
            return True
        if await self.metadata.placement(*key) == host:
            return True
        log.warning("container %s was moved to another host: this host's copy is dropped",
                    key[1])
        self._held.discard(key)
        await self._stop_here(key)
        await asyncio.to_thread(self.files.drop_local, *key)
        return False

    async def _hold(self, tenant: str, container_id: str) -> None:
        """Cluster mode: every use of a container happens on the one sandbox host
        that holds it, so its files have one writer. The first use places it
        here; a container another host holds is ContainerElsewhere. Once held,
        a host keeps it while it lives (a front end moves it only off a host the
        cluster reports gone), so the claim is made once per container."""
        host = self.settings.node_key
        key = (tenant, container_id)
        if not host or key in self._held:
            return
        holder = await self.metadata.claim_placement(tenant, container_id, host)
        if holder != host:
            raise ContainerElsewhere(holder)
        self._held.add(key)

    async def get_or_create(self, tenant: str, container_id: str) -> ContainerRecord:
        """A client-chosen id names its container: used, it exists (Zylon's model)."""
        try:
            return await self.get(tenant, container_id)
        except UnknownContainer:
            pass
        try:
            return await self.create(tenant, container_id, implicit=True)
        except ContainerExists:  # made by a concurrent request, here or on another front end
            return await self.get(tenant, container_id)

    def current(self, record: ContainerRecord) -> ContainerRecord:
        """The freshest state of a container known here (its last touch included)."""
        return self._records.get((record.tenant, record.id), record)

    async def list(self, tenant: str) -> list[ContainerRecord]:
        now = time.time()
        records = await self.metadata.list_containers(tenant)
        return [self._records.get((r.tenant, r.id), r) for r in records if r.expires_at > now]

    async def touch(self, record: ContainerRecord) -> ContainerRecord:
        key = (record.tenant, record.id)
        now = time.time()
        known = self._records.get(key)
        # What is known here of this generation only: a lookup may have moved the
        # cache on to a container made anew under the id, which a session of the
        # old one must not keep alive.
        this_generation = known is None or known.created_at == record.created_at
        current = (known if known is not None and this_generation else record).touched(now)
        if this_generation:
            self._records[key] = current
        if not this_generation or now - self._touch_written.get(key, 0.0) >= _TOUCH_WRITE_SECONDS:
            if this_generation:
                self._touch_written[key] = now
            if not await self.metadata.touch_container(current):
                # Retired or made anew by another front end meanwhile: what is
                # cached here of it is stale, and the store is not overwritten
                # with it. Its sandbox here, and the sessions on it, end as at a
                # retirement here (a call that just finished keeps its answer).
                cached = self._records.get(key)
                if cached is not None and cached.created_at == current.created_at:
                    self._records.pop(key, None)
                    self._touch_written.pop(key, None)
                live = self._live.get(key)
                if live is not None and live.created_at == current.created_at:
                    await self._stop_here(key)
        return current

    async def _stop_here(self, key: tuple[str, str]) -> None:
        """End the container's sessions on this front end, then stop its sandbox
        here: as it is retired, or found retired, made anew or moved elsewhere.
        Its sessions go first, so that a call cut off by the stop finds its
        session gone, and every later request answers 404, never a call into a
        stopped sandbox."""
        self.on_retire(*key)
        live = self._live.pop(key, None)
        if live is not None:
            await live.sandbox.close()

    async def delete(self, tenant: str, container_id: str) -> None:
        record = await self.get(tenant, container_id)
        await self._retire(record, "deleted")

    async def _retire(self, record: ContainerRecord, status: str) -> None:
        key = (record.tenant, record.id)
        async with self._id_lock(key):  # never beside a creation of the same id here
            await self._retire_locked(record, status)

    @contextlib.asynccontextmanager
    async def _id_lock(self, key: tuple[str, str]):
        """Creation and retirement of one id, one at a time on this front end; the
        lock is forgotten once nobody holds or waits for it."""
        lock = self._creating.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._creating.get(key) is lock:
                del self._creating[key]

    async def _retire_locked(self, record: ContainerRecord, status: str) -> None:
        key = (record.tenant, record.id)
        self._retiring.add(key)
        try:
            # Work that started first finishes first (a write is then deleted
            # with the container); none starts from here on.
            while self._users.get(key):
                await self._idle.setdefault(key, asyncio.Event()).wait()
            if status == "expired" and self._in_use_since(record):
                return
            await self._stop_here(key)
            self._records.pop(key, None)
            self._touch_written.pop(key, None)
            # One made anew under its id has not had a sandbox here; and without
            # this the set kept every container that ever had one.
            self._started_here.discard(key)
            # This container, by its creation time: never one made anew under its id.
            stored = await self.metadata.get_container(record.tenant, record.id)
            if (stored is None or stored.created_at != record.created_at
                    or stored.status != "active"):
                return
            # Files first, the status last: a crash in between leaves an active
            # container without files, which the reaper retires again.
            await asyncio.to_thread(self.files.destroy, record.tenant, record.id)
            await self.metadata.delete_container_files(record.tenant, record.id)
            await self.metadata.retire_container(record, status)
            if key in self._held:  # a container made anew under the id may go anywhere
                self._held.discard(key)
                await self.metadata.drop_placement(record.tenant, record.id)
        finally:
            self._retiring.discard(key)

    def _in_use_since(self, record: ContainerRecord) -> bool:
        """Whether a container found expired was used while its retirement waited
        for the work under way (a write touches it, a session holds its sandbox):
        in use is not expired."""
        key = (record.tenant, record.id)
        if self._records.get(key, record).expires_at > time.time():
            return True
        live = self._live.get(key)
        return live is not None and live.users > 0

    @contextlib.asynccontextmanager
    async def using(self, record: ContainerRecord):
        """Work on the container's files: UnknownContainer if it was retired (or is
        being retired) since ``record`` was read; its retirement waits until the
        work is done. Work that waits for the container's id lock, or for its
        retirement, must not run inside (the retirement would wait for it)."""
        key = (record.tenant, record.id)
        if not await self._exists(record):
            raise UnknownContainer(f"no container {record.id!r}")
        # No await between the check and the count: a retirement that starts
        # after the check waits for this work.
        self._users[key] = self._users.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._users[key] - 1
            if left:
                self._users[key] = left
            else:
                del self._users[key]
                idle = self._idle.pop(key, None)
                if idle is not None:
                    idle.set()

    async def _exists(self, record: ContainerRecord) -> bool:
        """Whether ``record``'s container (this generation of its id) is not retired.
        Expiry alone does not count: a container in use is retired only once its
        users are done, and they finish their work on it."""
        key = (record.tenant, record.id)
        if key in self._retiring:
            return False
        known = self._records.get(key)
        if known is None or known.created_at != record.created_at:
            known = await self.metadata.get_container(record.tenant, record.id)
            if key in self._retiring:
                return False
        return (known is not None and known.status == "active"
                and known.created_at == record.created_at)

    async def _volume(self, record: ContainerRecord, open_it: Callable):
        """``open_it`` (a store call that may raise VolumeMissing) run in a thread,
        the container's volume made first if it has none: a container is made
        without one (an unused container costs no disk), and so are containers
        on a host that takes over one never snapshotted (cluster mode). Called
        inside using(), so the container exists and stays while this runs."""
        try:
            return await asyncio.to_thread(open_it)
        except VolumeMissing:
            await asyncio.to_thread(self.files.create, record.tenant, record.id)
            return await asyncio.to_thread(open_it)

    # -- sandboxes --------------------------------------------------------------------
    async def acquire(self, record: ContainerRecord) -> tuple[Sandbox, bool]:
        """The container's live sandbox, started if needed; and whether earlier
        interpreter state was lost (a fresh sandbox on a container used before)."""
        async with self.using(record):  # never a sandbox on a retired container's files
            return await self._acquire(record)

    async def _acquire(self, record: ContainerRecord) -> tuple[Sandbox, bool]:
        key = (record.tenant, record.id)
        while key in self._starting:
            await asyncio.shield(self._starting[key])
        live = self._live.get(key)
        if live is not None and not live.sandbox.closed and live.created_at == record.created_at:
            live.users += 1
            return live.sandbox, False
        starting = asyncio.get_running_loop().create_future()
        self._starting[key] = starting
        try:
            if live is not None and live.created_at != record.created_at:
                # A container deleted and made anew under this id by another
                # front end: the old one's sandbox and files here are not its, and
                # the sessions on them (all of the old generation: a session of
                # the new one would have come through here first) end with them.
                await self._stop_here(key)
                await asyncio.to_thread(self.files.drop_local, record.tenant, record.id)
            # Up to date first: a container another host worked on since is
            # restored from its snapshot (cluster mode).
            home, elsewhere = await self._volume(
                record, lambda: self.files.attach(record.tenant, record.id))
            tier = MEMORY_TIERS_MIB.get(record.memory_limit or "")
            sandbox = await self.pool.launch_for(home, record.id[:16],
                                                 tier * 1024 * 1024 if tier else None)
            self._live[key] = _Live(sandbox, users=1, created_at=record.created_at,
                                    checkpointed=time.monotonic())
        finally:
            del self._starting[key]
            starting.set_result(None)
        # A sandbox ran on these files before (here, or before this server
        # started): whatever its interpreter held is gone now.
        restarted = (key in self._started_here or record.created_at < self._server_started
                     or elsewhere)
        self._started_here.add(key)
        try:
            await self.touch(record)
        except BaseException:
            # Cancelled (or failed) here, the caller never gets the sandbox to
            # give back: left in use, the idle reaper would never stop it.
            self.release(record)
            raise
        if sandbox.closed:
            # The store refused the touch: deleted or made anew elsewhere while
            # this sandbox started, and touch() stopped it.
            raise UnknownContainer(f"no container {record.id!r}")
        return sandbox, restarted

    def usage(self) -> tuple[int, int]:
        """Containers with files and the disk they use (blocking: a directory walk)."""
        return self.files.usage()

    def release(self, record: ContainerRecord) -> None:
        live = self._live.get((record.tenant, record.id))
        if live is not None:
            live.users = max(0, live.users - 1)
            live.last_used = time.monotonic()

    async def files_of(self, record: ContainerRecord):
        """Path-safe access to the container's files, as its live sandbox's uid; to
        be called, and used, inside using()."""
        live = self._live.get((record.tenant, record.id))
        uid = live.sandbox.uid if live is not None and not live.sandbox.closed else 0
        return await self._volume(record, lambda: self.files.files(record.tenant, record.id, uid))

    # -- skills ---------------------------------------------------------------------------
    def check_skills(self, names: list[str]) -> list[Path]:
        """The operator's folders for these skills, or UnknownSkill."""
        root = self.settings.skills_dir
        folders = []
        for name in names:
            if not isinstance(name, str) or not _SKILL_NAME.match(name):
                raise UnknownSkill(f"{name!r} is not a skill name")
            folder = root / name if root is not None else None
            if folder is None or not folder.is_dir() or folder.is_symlink():
                raise UnknownSkill(f"no skill {name!r} is installed on this server")
            folders.append(folder)
        return folders

    async def select_skills(self, record: ContainerRecord, names: list[str]) -> None:
        """Mount exactly these skills under the container's /mnt/skills (read-only
        inside): copied onto its volume when the choice changes, so a live sandbox
        sees the change at once."""
        folders = self.check_skills(names)
        async with self.using(record):
            home = await self._volume(record, lambda: self.files.home(record.tenant, record.id))
            await asyncio.to_thread(_lay_out_skills, home.skills, folders)

    # -- reaping ------------------------------------------------------------------------
    async def reap(self) -> None:
        now = time.monotonic()
        idle = [key for key, live in self._live.items()
                if live.users == 0 and key not in self._starting
                and now - live.last_used >= self.settings.container_sandbox_idle_seconds]
        loop = asyncio.get_running_loop()
        for key in idle:
            live = self._live.pop(key)
            log.info("shutting down idle sandbox of container %s", key[1])
            # A use that comes meanwhile waits for the volume to be let go, then
            # starts anew (_acquire waits on _starting): else its new sandbox
            # mounted the volume that this detach unmounted under it.
            stopping = self._starting[key] = loop.create_future()
            try:
                await live.sandbox.close()
                if await self._still_held(key):
                    await asyncio.to_thread(self.files.detach, *key)  # its last snapshot, if kept
            finally:
                del self._starting[key]
                stopping.set_result(None)
        if self.files.snapshots:
            await self._checkpoint_due(now)
            if self.settings.node_key:
                await self._drop_stale_copies()
        # A sandbox host reaps what is placed on it (another host's are its
        # holder's), by the placements, not by what it used since it started: a
        # host whose server restarted on its node holds what it held before, and
        # the expired among them were reaped by no one, their rows and snapshots
        # kept for ever.
        for record in await self.metadata.expired_containers(time.time(),
                                                             self.settings.node_key or None):
            if self.settings.node_key:
                self._held.add((record.tenant, record.id))  # its placement goes with it
            current = self._records.get((record.tenant, record.id), record)
            if current.expires_at > time.time():
                continue  # touched since the last write-through
            live = self._live.get((record.tenant, record.id))
            if live is not None and live.users:
                continue  # in use: a session's activity keeps it alive
            log.info("container %s expired", record.id)
            await self._retire(current, "expired")
        if now - self._forgot_retired_at >= _FORGET_RETIRED_EVERY_SECONDS:
            self._forgot_retired_at = now
            forgotten = await self.metadata.forget_retired_containers(
                time.time() - RETIRED_ROWS_KEPT_SECONDS)
            if forgotten:
                log.info("forgot %d containers retired more than a day ago", forgotten)
        if self.settings.node_key and self.hosts_gone is not None:
            await self._reap_orphans()  # last: Ray not answering stops nothing else

    async def _reap_orphans(self) -> None:
        """Cluster mode: expired containers placed on a host whose node left the
        cluster (or on none), a few per round. No holder is left to reap them,
        and a front end moves a container only for its next use, which an
        expired one never gets: so of every host lost, the containers no one
        used again kept their rows and their snapshots for ever. Each is taken
        over here (atomically: of the hosts doing this, one gets it) and
        retired, its snapshot with it."""
        host = self.settings.node_key
        others = [record for record in await self.metadata.expired_containers(time.time())
                  if (record.tenant, record.id) not in self._held]
        if not others or self.hosts_gone is None:
            return
        start = self._orphans_cursor % len(others)
        batch = (others[start:] + others[:start])[:_STALE_COPIES_PER_ROUND]
        self._orphans_cursor = start + len(batch)
        holders = {(r.tenant, r.id): await self.metadata.placement(r.tenant, r.id) for r in batch}
        gone = await self.hosts_gone({holder for holder in holders.values() if holder})
        for record in batch:
            key = (record.tenant, record.id)
            holder = holders[key]
            if holder is not None and holder not in gone:
                continue  # its holder's to reap
            if await self.metadata.claim_placement(*key, host, replacing=holder) != host:
                continue  # another host took it over first
            self._held.add(key)
            log.info("container %s expired on sandbox host %s, which left the cluster: "
                     "retired here", record.id, holder)
            await self._retire(record, "expired")

    async def _drop_stale_copies(self) -> None:
        """Cluster mode: this host's copies of containers it does not hold, dropped
        a few per round. Another host holds them now (moved off this one while it
        was cut off or gone), or they are no more; the holder restores from the
        bucket, never from here, so a copy left would hold disk forever."""
        copies = await asyncio.to_thread(self.files.local_copies)
        if not copies:
            return
        start = self._stale_cursor % len(copies)
        batch = (copies[start:] + copies[:start])[:_STALE_COPIES_PER_ROUND]
        self._stale_cursor = start + len(batch)
        for key in batch:
            if key in self._live or key in self._starting:
                continue  # a sandbox works on it here: checked as it is used
            if await self.metadata.placement(*key) == self.settings.node_key:
                continue  # ours: kept for its next sandbox
            self._held.discard(key)
            if await asyncio.to_thread(self.files.drop_idle_copy, *key):
                log.info("dropped this host's copy of container %s: another host holds it, "
                         "or it is gone", key[1])

    async def _checkpoint_due(self, now: float) -> None:
        """Snapshot live containers whose last snapshot is older than the interval,
        and retry those whose last one failed."""
        due = [key for key, live in self._live.items()
               if now - live.checkpointed >= self.settings.snapshot_interval_seconds]
        for key in due:
            self._live[key].checkpointed = now
        for key in dict.fromkeys([*due, *self.files.unsaved()]):
            try:
                if await self._still_held(key):
                    await asyncio.to_thread(self.files.checkpoint, *key, key in self._live)
            except StoreUnavailable:
                pass  # logged by the store; kept in its unsaved list, tried next time
            except Exception:  # noqa: BLE001 - one container's failure stops no other's
                log.exception("could not snapshot container %s", key[1])

    async def checkpoint(self, record: ContainerRecord) -> None:
        """What was just written to the container, durable beyond this host before
        it is acknowledged (a no-op without an object store)."""
        if self.files.snapshots:
            key = (record.tenant, record.id)
            if not await self._still_held(key):
                # Written here, on a copy that is not the container's any more: the
                # front end sends the request again, to the holder.
                raise ContainerElsewhere(await self.metadata.placement(*key) or "")
            await asyncio.to_thread(self.files.checkpoint, record.tenant, record.id,
                                    key in self._live)

    async def close(self) -> None:
        for key, record in list(self._records.items()):
            await self.metadata.touch_container(record)
        lives, self._live = list(self._live.items()), {}
        await asyncio.gather(*(live.sandbox.close() for _, live in lives), return_exceptions=True)
        # Each container's last snapshot (cluster mode), as at an idle shutdown, and
        # another try for those whose last one failed.
        for key in dict.fromkeys([key for key, _ in lives] + self.files.unsaved()):
            try:
                if await self._still_held(key):
                    await asyncio.to_thread(self.files.detach, *key)
            except Exception:  # noqa: BLE001 - the rest still get theirs
                log.exception("could not detach container %s", key[1])
        if self.files.unsaved():
            log.error("stopping with %d containers not snapshotted: their latest files are "
                      "on this host only", len(self.files.unsaved()))
        await asyncio.to_thread(self.files.close)


def _lay_out_skills(target: Path, folders: list[Path]) -> None:
    """Replace the skills under ``target`` with copies of ``folders``; a no-op
    when they are already there (same names, same modification times)."""
    wanted = {folder.name: folder.stat().st_mtime_ns for folder in folders}
    marker = target / _SKILLS_MARKER
    try:
        if json.loads(marker.read_text()) == wanted:
            return
    except (OSError, ValueError):
        pass
    total = sum(_size(folder) for folder in folders)
    if total > _SKILLS_MAX_BYTES:
        raise InvalidContainer(f"the chosen skills hold {total} bytes; at most "
                               f"{_SKILLS_MAX_BYTES} may be mounted")
    target.mkdir(mode=0o755, exist_ok=True)
    for entry in list(target.iterdir()):  # only the host writes here
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for folder in folders:
        # Skills belong to the operator: copied without following links out of them.
        shutil.copytree(folder, target / folder.name, symlinks=True)
        for directory, _, files in os.walk(target / folder.name):
            os.chmod(directory, 0o755)
            for name in files:
                path = os.path.join(directory, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o644 | (os.stat(path).st_mode & 0o111))
    marker.write_text(json.dumps(wanted))


def _size(folder: Path) -> int:
    return sum(entry.stat(follow_symlinks=False).st_size
               for entry in folder.rglob("*") if entry.is_file() and not entry.is_symlink())
