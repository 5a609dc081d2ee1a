"""Client-named containers (Zylon's threads, Files API scopes): made once, and a
name freed by expiry starts empty.

The container manager on a real SQLite store and real ext4 volumes. A client's
id may name a container that expired while no reaper ran (the server was down,
or the reaper had not come round yet): creating it again must not hand the new
container the old one's files. Requests racing to create one id make one
container, and each gets it.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest

from shoal.config import MiB, Settings
from shoal.sandbox.files import FileMissing, SandboxPath
from shoal.sandbox.mounts import OUTPUTS
from shoal.sessions import ContainerExists, ContainerManager, UnknownContainer
from shoal.storage import ContainerRecord, LocalFileStore, SqliteMetadataStore

OLD_FILE = SandboxPath(OUTPUTS, ("old.txt",))


@pytest.fixture
async def manager(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", run_dir=Path("/run/shoal-test"))
    metadata = SqliteMetadataStore(tmp_path / "shoal.sqlite3")
    await metadata.open()
    files = LocalFileStore(settings.data_dir, settings.run_dir, 64 * MiB, MiB)
    yield ContainerManager(settings, None, metadata, files)
    for tenant, container_id in (("alpha", "thread-1"), ("alpha", "thread-2")):
        files.destroy(tenant, container_id)
    files.close()
    await metadata.close()


async def _expired_with_a_file(manager, content: bytes) -> float:
    """thread-1, used an hour ago with a one-minute TTL, OLD_FILE still in it: no
    reaper has retired it. Returns when it was last used."""
    hour_ago = time.time() - 3600
    await manager.metadata.put_container(ContainerRecord(
        tenant="alpha", id="thread-1", name=None, created_at=hour_ago,
        last_active_at=hour_ago, expires_after_minutes=1))
    manager.files.create("alpha", "thread-1")
    manager.files.files("alpha", "thread-1", 0).write(OLD_FILE, io.BytesIO(content))
    return hour_ago


async def test_a_client_id_freed_by_expiry_starts_empty(manager):
    hour_ago = await _expired_with_a_file(manager, b"old secrets")
    assert manager.files.files("alpha", "thread-1", 0).stat(OLD_FILE).size == 11  # control

    fresh = await manager.get_or_create("alpha", "thread-1")
    assert fresh.created_at > hour_ago and fresh.expires_at > time.time()
    async with manager.using(fresh):
        with pytest.raises(FileMissing):
            (await manager.files_of(fresh)).stat(OLD_FILE)
    assert (await manager.metadata.get_container("alpha", "thread-1")).status == "active"


async def test_racing_requests_for_an_expired_id_make_one_new_container(manager):
    await _expired_with_a_file(manager, b"old")
    made = await asyncio.gather(*(manager.get_or_create("alpha", "thread-1") for _ in range(8)))
    assert len({record.created_at for record in made}) == 1, made
    new_file = SandboxPath(OUTPUTS, ("new.txt",))
    async with manager.using(made[0]):
        (await manager.files_of(made[0])).write(new_file, io.BytesIO(b"new"))
    # Later requests find the new container and keep its files.
    again = await asyncio.gather(*(manager.get_or_create("alpha", "thread-1") for _ in range(4)))
    assert {record.created_at for record in again} == {made[0].created_at}
    assert manager.files.files("alpha", "thread-1", 0).stat(new_file).size == 3
    stored = await manager.metadata.get_container("alpha", "thread-1")
    assert (stored.created_at, stored.status) == (made[0].created_at, "active")


async def test_a_live_client_id_is_never_created_twice(manager):
    first = await manager.create("alpha", "thread-2", implicit=True)
    with pytest.raises(ContainerExists):
        await manager.create("alpha", "thread-2", implicit=True)
    # Racing requests for one new id all get the one container.
    made = await asyncio.gather(*(manager.get_or_create("alpha", "thread-1") for _ in range(8)))
    assert {(r.id, r.created_at) for r in made} == {(made[0].id, made[0].created_at)}
    assert (await manager.get_or_create("alpha", "thread-2")).created_at == first.created_at


async def test_a_front_ends_stale_copy_never_brings_back_a_deleted_container(manager, tmp_path):
    # Two front ends on one store (the cluster's shape; here one SQLite file):
    # the other one deletes thread-2 while this one still has it cached and
    # then writes its last activity through.
    made = await manager.create("alpha", "thread-2", implicit=True)
    other = ContainerManager(manager.settings, None, manager.metadata, manager.files)
    assert (await other.get("alpha", "thread-2")).created_at == made.created_at
    await other.delete("alpha", "thread-2")
    await manager.touch(made)
    stored = await manager.metadata.get_container("alpha", "thread-2")
    assert stored.status == "deleted", "a stale touch resurrected a deleted container"
    with pytest.raises(UnknownContainer):
        await manager.get("alpha", "thread-2")
    # Nor, at shutdown, does the stale copy overwrite a container made anew.
    anew = await other.create("alpha", "thread-2", implicit=True)
    await manager.touch(made)
    manager._records[("alpha", "thread-2")] = made
    await manager.close()
    stored = await manager.metadata.get_container("alpha", "thread-2")
    assert (stored.created_at, stored.status) == (anew.created_at, "active")


@pytest.fixture
async def two_front_ends(tmp_path, pool):
    """Two container managers on one store and one node's files, with real sandboxes."""
    settings = Settings(data_dir=tmp_path / "data", run_dir=Path("/run/shoal-test"))
    metadata = SqliteMetadataStore(tmp_path / "shoal.sqlite3")
    await metadata.open()
    files = LocalFileStore(settings.data_dir, settings.run_dir, 64 * MiB, MiB)
    managers = [ContainerManager(settings, pool, metadata, files) for _ in range(2)]
    yield managers
    for manager in managers:
        for live in list(manager._live.values()):
            await live.sandbox.close()
    files.destroy("alpha", "thread-3")
    files.close()
    await metadata.close()


async def test_a_container_made_anew_elsewhere_never_gets_the_old_ones_sandbox(two_front_ends):
    here, other = two_front_ends
    old = await here.create("alpha", "thread-3", implicit=True)
    sandbox, _ = await here.acquire(old)
    assert (await sandbox.run_python("secret = 'old generation'")).return_code == 0
    here.release(old)
    await other.delete("alpha", "thread-3")
    anew = await other.create("alpha", "thread-3", implicit=True)
    # This front end reads the new generation from the store (a cache miss).
    here._records.pop(("alpha", "thread-3"), None)
    current = await here.get("alpha", "thread-3")
    assert current.created_at == anew.created_at
    fresh, _ = await here.acquire(current)
    try:
        assert fresh is not sandbox and sandbox.closed
        seen = await fresh.run_python("print('secret' in globals())")
        assert seen.stdout == "False\n", seen.stderr
    finally:
        here.release(current)


async def test_a_refused_touch_stops_the_stale_sandbox(two_front_ends):
    here, other = two_front_ends
    record = await here.create("alpha", "thread-3", implicit=True)
    sandbox, _ = await here.acquire(record)
    here.release(record)
    await other.delete("alpha", "thread-3")
    here._touch_written.clear()  # the next touch writes through
    await here.touch(record)
    assert sandbox.closed and ("alpha", "thread-3") not in here._live
    with pytest.raises(UnknownContainer):
        await here.get("alpha", "thread-3")


async def test_an_acquire_cancelled_once_its_sandbox_started_leaves_it_unused(two_front_ends):
    """Cancelled after the sandbox was registered as in use (while the last
    activity was written), the caller never got it to give back: it stayed in
    use for good, and the idle reaper never stopped it."""
    here, _ = two_front_ends
    record = await here.create("alpha", "thread-3", implicit=True)
    key = ("alpha", "thread-3")
    here._touch_written.clear()  # the touch writes through: the task waits on the store
    acquiring = asyncio.create_task(here.acquire(record))
    while key not in here._live and not acquiring.done():
        await asyncio.sleep(0)
    assert not acquiring.done(), "the acquire finished without waiting on the store"
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    assert here._live[key].users == 0
