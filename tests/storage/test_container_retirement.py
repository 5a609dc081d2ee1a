"""A container's deletion and the work on its files never overlap.

The container manager on a real SQLite store and real ext4 volumes. A request
reads the container's record, then works on its files (a slow upload reads its
whole body in between): a deletion in between must not let the work bring the
volume back, and a deletion during the work waits for it, then deletes what it
wrote. The file store itself never makes a volume it is asked for: that is the
container manager's, which knows whether the container still exists.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import pytest

from shoal.config import MiB, Settings
from shoal.sandbox.files import SandboxPath
from shoal.sandbox.mounts import UPLOADS
from shoal.sessions import ContainerFiles, ContainerManager, UnknownContainer
from shoal.storage import (ContainerRecord, LocalFileStore, SqliteMetadataStore,
                           VolumeMissing)

IDS = ("box-1", "box-2", "box-3")


@pytest.fixture
async def manager(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", run_dir=Path("/run/shoal-test"))
    metadata = SqliteMetadataStore(tmp_path / "shoal.sqlite3")
    await metadata.open()
    files = LocalFileStore(settings.data_dir, settings.run_dir, 64 * MiB, MiB)
    yield ContainerManager(settings, None, metadata, files)
    for container_id in IDS:
        files.destroy("alpha", container_id)
    files.close()
    await metadata.close()


def _image(manager: ContainerManager, container_id: str) -> Path:
    return manager.files.volume("alpha", container_id).image


class _HeldSource:
    """A body that arrives only once ``release`` is set (a slow client)."""

    def __init__(self, data: bytes) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        self._data = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        self.reading.set()
        assert self.release.wait(30), "never released"
        return self._data.read(size)


def test_the_file_store_never_makes_a_volume_it_is_asked_for(manager):
    for ask in (lambda: manager.files.home("alpha", "box-1"),
                lambda: manager.files.attach("alpha", "box-1"),
                lambda: manager.files.files("alpha", "box-1", 0)):
        with pytest.raises(VolumeMissing):
            ask()
    assert not _image(manager, "box-1").exists()
    home = manager.files.create("alpha", "box-1")
    assert _image(manager, "box-1").exists() and home.workspace.is_dir()
    assert manager.files.home("alpha", "box-1").root == home.root


@pytest.mark.parametrize("used", [False, True], ids=["never-used", "used"])
async def test_work_on_a_container_deleted_since_its_lookup_is_refused(manager, used):
    container_files = ContainerFiles(manager, manager.metadata)
    record = await manager.create("alpha", "box-2")
    if used:
        await container_files.put(record, SandboxPath(UPLOADS, ("old.txt",)), io.BytesIO(b"old"))
        assert _image(manager, "box-2").exists()  # control
    looked_up = await manager.get("alpha", "box-2")
    await manager.delete("alpha", "box-2")
    with pytest.raises(UnknownContainer):
        await container_files.put(looked_up, SandboxPath(UPLOADS, ("late.txt",)),
                                  io.BytesIO(b"late"))
    for work in (container_files.list(looked_up), manager.acquire(looked_up),
                 manager.select_skills(looked_up, [])):
        with pytest.raises(UnknownContainer):
            await work
    assert not _image(manager, "box-2").exists(), "the deleted container's volume came back"
    assert await manager.metadata.list_files("alpha", "box-2") == []


async def test_a_deletion_waits_for_a_write_under_way_then_deletes_it(manager):
    container_files = ContainerFiles(manager, manager.metadata)
    record = await manager.create("alpha", "box-3")
    source = _HeldSource(b"written first")
    writing = asyncio.create_task(
        container_files.put(record, SandboxPath(UPLOADS, ("first.txt",)), source))
    assert await asyncio.to_thread(source.reading.wait, 30)
    deleting = asyncio.create_task(manager.delete("alpha", "box-3"))
    await asyncio.sleep(0.3)
    assert not deleting.done(), "the deletion did not wait for the write under way"
    with pytest.raises(UnknownContainer):  # already gone to anyone who looks
        await manager.get("alpha", "box-3")
    source.release.set()
    written = await writing
    assert written.record.size == len(b"written first")
    await deleting
    assert not _image(manager, "box-3").exists()
    assert await manager.metadata.list_files("alpha", "box-3") == []
    assert (await manager.metadata.get_container("alpha", "box-3")).status == "deleted"


async def test_an_expired_container_written_to_while_the_reaper_waited_is_kept(manager):
    # Expired an hour ago, not reaped yet; a write that began before the reaper came
    # round (its upload's record read in time) is activity, as a session's call is.
    hour_ago = time.time() - 3600
    record = ContainerRecord(tenant="alpha", id="box-1", name=None, created_at=hour_ago,
                             last_active_at=hour_ago, expires_after_minutes=1)
    await manager.metadata.put_container(record)
    container_files = ContainerFiles(manager, manager.metadata)
    source = _HeldSource(b"kept")
    writing = asyncio.create_task(
        container_files.put(record, SandboxPath(UPLOADS, ("kept.txt",)), source))
    assert await asyncio.to_thread(source.reading.wait, 30)
    reaping = asyncio.create_task(manager.reap())
    await asyncio.sleep(0.3)
    assert not reaping.done(), "the reaper did not wait for the write under way"
    source.release.set()
    await writing
    await reaping
    assert (await manager.metadata.get_container("alpha", "box-1")).status == "active"
    assert _image(manager, "box-1").exists()
    assert [row.path for row in await manager.metadata.list_files("alpha", "box-1")] == [
        f"{UPLOADS}/kept.txt"]
