"""Disk quotas as filesystems: one sparse ext4 image per container, loop-mounted.

Counting bytes after the fact cannot stop code that is filling the disk; a
filesystem of its own can: code that writes past its container's quota gets
ENOSPC (or runs out of inodes) from the kernel, and the host's disk and every
other container are untouched. The image is sparse, so a container costs the
host only what it really stores, and it is a plain file, so it survives a
restart of the server (or of the machine) with everything in it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

MKFS = "/usr/sbin/mkfs.ext4"


class VolumeError(RuntimeError):
    """A volume could not be created, mounted or removed."""


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise VolumeError(f"{' '.join(argv[:2])} failed: {result.stderr.strip() or result.returncode}")


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        return [line.split()[4] for line in handle]


def is_mounted(mount_point: Path) -> bool:
    return str(mount_point.resolve()) in _mount_points()


def mounts_under(directory: Path) -> list[Path]:
    prefix = str(directory.resolve()) + "/"
    return [Path(point) for point in _mount_points() if point.startswith(prefix)]


def unmount(mount_point: Path) -> None:
    # The last processes of a killed sandbox may still hold the filesystem for
    # a moment; retry briefly, then detach it lazily rather than leak it.
    for _ in range(20):
        try:
            _run(["umount", str(mount_point)])
            return
        except VolumeError as exc:
            if "busy" not in str(exc):
                raise
            time.sleep(0.05)
    _run(["umount", "--lazy", str(mount_point)])


class Volume:
    """An ext4 image at ``image``, mounted at ``mount_point`` while in use."""

    def __init__(self, image: Path, mount_point: Path) -> None:
        self.image = image
        self.mount_point = mount_point

    @property
    def exists(self) -> bool:
        return self.image.exists()

    def create(self, size_bytes: int, journal: bool = True) -> None:
        """Make the image and its filesystem; the volume is then mounted."""
        self.image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.image.with_suffix(".partial")
        with open(partial, "wb") as handle:
            handle.truncate(size_bytes)
        features = [] if journal else ["-O", "^has_journal"]
        try:
            # -m 0: no blocks reserved for root, the quota is all the user's.
            _run([MKFS, "-q", "-F", "-m", "0", *features, str(partial)])
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.rename(partial, self.image)
        self.mount()

    def mount(self) -> None:
        if is_mounted(self.mount_point):
            return
        self.mount_point.mkdir(parents=True, exist_ok=True)
        _run(["mount", "-o", "loop,nosuid,nodev", str(self.image), str(self.mount_point)])
        os.chmod(self.mount_point, 0o711)

    def unmount(self) -> None:
        if is_mounted(self.mount_point):
            unmount(self.mount_point)

    def destroy(self) -> None:
        """Unmount and delete the image: every byte in it is gone."""
        self.unmount()
        self.image.unlink(missing_ok=True)
        try:
            self.mount_point.rmdir()
        except OSError:
            pass
