"""The local file store leaves nothing of its own in the run directory once
closed: its container volumes unmounted, their mount points and its directory
removed (each data directory has one: a server started on a new one each time,
as the suites do, left one more each time); the files stay in the images."""

from __future__ import annotations

import io
from pathlib import Path

from shoal.config import MiB
from shoal.sandbox.files import SandboxPath
from shoal.sandbox.mounts import OUTPUTS
from shoal.sandbox.volumes import is_mounted
from shoal.storage import LocalFileStore

RUN_DIR = Path("/run/shoal-test")


def test_a_closed_store_leaves_no_mount_point_behind(tmp_path):
    files = LocalFileStore(tmp_path / "data", RUN_DIR, 64 * MiB, MiB)
    mounts = files.volume("alpha", "thread-1").mount_point.parent.parent
    try:
        for container in ("thread-1", "thread-2"):
            files.create("alpha", container)
            files.files("alpha", container, 0).write(SandboxPath(OUTPUTS, ("kept.txt",)),
                                                     io.BytesIO(b"kept"))
        files.detach("alpha", "thread-2")  # unmounted before the close: its mount point stays
        assert mounts.is_dir() and is_mounted(files.volume("alpha", "thread-1").mount_point)
    finally:
        files.close()
    assert not mounts.exists(), sorted(str(path) for path in mounts.rglob("*"))
    # The files are in the images, not the mount points: opened again, they are there.
    again = LocalFileStore(tmp_path / "data", RUN_DIR, 64 * MiB, MiB)
    try:
        for container in ("thread-1", "thread-2"):
            read = again.files("alpha", container, 0).open_for_reading(
                SandboxPath(OUTPUTS, ("kept.txt",)))[0]
            with read:
                assert read.read() == b"kept"
    finally:
        for container in ("thread-1", "thread-2"):
            again.destroy("alpha", container)
        again.close()
    assert not mounts.exists()
