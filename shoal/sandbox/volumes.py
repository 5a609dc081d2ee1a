"""Disk quotas as filesystems: one sparse ext4 image per container, loop-mounted.

Counting bytes after the fact cannot stop code that is filling the disk; a
filesystem of its own can: code that writes past its container's quota gets
ENOSPC (or runs out of inodes) from the kernel, and the host's disk and every
other container are untouched. The image is sparse, so a container costs the
host only what it really stores, and it is a plain file, so it survives a
restart of the server (or of the machine) with everything in it. Its inode
tables and journal are left for the kernel to treat as empty (lazy init, and
``noinit_itable`` so they are never zeroed), which keeps an empty volume at
well under a megabyte of real disk.

Sparse images could promise more than the disk holds, and a loop device whose
backing file cannot grow loses writes. So no volume is created or mounted
unless the filesystem under the images has room for it to fill its quota on
top of what every volume this process has mounted may still write.

Volumes are made and mounted without starting a process: a new image is a
copy of the few hundred KiB that ``mkfs.ext4`` wrote for the first volume of
its size (kept in memory), and the loop mount is three system calls
(:mod:`shoal.sandbox._loop`). The copies share that first image's UUID and
directory-hash seed, which only the host can read (a sandbox has no block
device), and which each server process draws afresh.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

from . import _loop
from ._mountinfo import mount_table

MKFS = "/usr/sbin/mkfs.ext4"
# Left free under the images beyond every volume's promise: the metadata and the
# server's own files need some room too.
RESERVE_MARGIN_BYTES = 64 * 1024 * 1024


class VolumeError(RuntimeError):
    """A volume could not be created, mounted or removed."""


class DiskFull(VolumeError):
    """The disk under the images cannot back another volume's quota now."""


# Mount point -> image, of every volume this process has mounted.
_mounted: dict[Path, Path] = {}
# (size, journal) -> the data extents (offset, bytes) of a fresh filesystem of
# that shape; a handful of shapes exist (the operator's quotas), a few are kept.
_templates: dict[tuple[int, bool], list[tuple[int, bytes]]] = {}
_templates_lock = threading.Lock()
_TEMPLATES_KEPT = 8


def _promised(device: int) -> int:
    """What the mounted volumes on one filesystem may still write, in bytes."""
    total = 0
    for mount_point, image in list(_mounted.items()):
        try:
            if image.stat().st_dev != device:
                continue
            quota = image.stat().st_size
            disk = os.statvfs(mount_point)
            used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        except OSError:
            continue
        total += max(0, quota - used)
    return total


def check_room(image: Path, quota: int) -> None:
    """Refuse a volume the disk under ``image`` could not back to its quota."""
    directory = image.parent
    disk = os.statvfs(directory)
    free = disk.f_bavail * disk.f_frsize
    needed = quota - (image.stat().st_blocks * 512 if image.exists() else 0)
    promised = _promised(directory.stat().st_dev)
    if free - promised < needed + RESERVE_MARGIN_BYTES:
        raise DiskFull(f"the disk under {directory} has {free // 2**20} MiB free, and "
                       f"{promised // 2**20} MiB are promised to live volumes: it cannot back "
                       f"another {quota // 2**20} MiB volume now")


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise VolumeError(f"{' '.join(argv[:2])} failed: {result.stderr.strip() or result.returncode}")


def _mount_points() -> list[str]:
    return [point for point, _fstype, _options in mount_table()]


def is_mounted(mount_point: Path) -> bool:
    """Whether a volume is mounted at ``mount_point``: a volume is a filesystem of
    its own, so the directory is on another device than its parent (a stat of
    each, where reading the mount table would cost a line per live volume)."""
    return os.path.ismount(mount_point)


def mounts_under(directory: Path) -> list[Path]:
    prefix = str(directory.resolve()) + "/"
    return [Path(point) for point in _mount_points() if point.startswith(prefix)]


def unmount(mount_point: Path) -> None:
    # The last processes of a killed sandbox may still hold the filesystem for
    # a moment; retry briefly, then detach it lazily rather than leak it.
    _mounted.pop(Path(mount_point).resolve(), None)
    try:
        for _ in range(20):
            try:
                _loop.unmount(str(mount_point))
                return
            except _loop.LoopError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.05)
        _loop.unmount(str(mount_point), lazy=True)
    except _loop.LoopError as exc:
        raise VolumeError(str(exc)) from None


def _template(directory: Path, size_bytes: int, journal: bool) -> list[tuple[int, bytes]]:
    """What a fresh ext4 filesystem of this size holds: made once with mkfs."""
    key = (size_bytes, journal)
    with _templates_lock:
        extents = _templates.get(key)
        if extents is not None:
            return extents
        scratch = directory / f".template-{os.getpid()}-{threading.get_ident()}.partial"
        try:
            with open(scratch, "wb") as handle:
                handle.truncate(size_bytes)
            features = [] if journal else ["-O", "^has_journal"]
            # -m 0: no blocks reserved for root, the quota is all the user's; lazy
            # init: a fresh sparse image reads as zeros, nothing needs writing.
            _run([MKFS, "-q", "-F", "-m", "0", *features,
                  "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(scratch)])
            extents = _data_extents(scratch)
        finally:
            scratch.unlink(missing_ok=True)
        while len(_templates) >= _TEMPLATES_KEPT:
            _templates.pop(next(iter(_templates)))
        _templates[key] = extents
        return extents


def _data_extents(path: Path) -> list[tuple[int, bytes]]:
    extents = []
    with open(path, "rb") as handle:
        fd, size, position = handle.fileno(), os.fstat(handle.fileno()).st_size, 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # only a hole remains
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, _read_at(fd, end - start, start)))
            position = end
    return extents


def _read_at(fd: int, size: int, offset: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 24), offset)
        if not chunk:
            raise VolumeError("the filesystem template ended early")
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class Volume:
    """An ext4 image at ``image``, mounted at ``mount_point`` while in use."""

    def __init__(self, image: Path, mount_point: Path) -> None:
        self.image = image
        self.mount_point = mount_point

    @property
    def exists(self) -> bool:
        return self.image.exists()

    def create(self, size_bytes: int, journal: bool = True) -> None:
        """Make the image and its filesystem; the volume is then mounted. A
        journalled volume (a durable container's) reaches the disk before it is
        used, as mkfs's own output did; a scratch volume dies with its sandbox."""
        self.image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_room(self.image, size_bytes)
        extents = _template(self.image.parent, size_bytes, journal)
        partial = self.image.with_suffix(".partial")
        try:
            with open(partial, "wb") as handle:
                handle.truncate(size_bytes)
                for offset, data in extents:
                    _write_at(handle.fileno(), data, offset)
                if journal:
                    os.fsync(handle.fileno())
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.rename(partial, self.image)
        self.mount(fresh=True)

    def mount(self, fresh: bool = False) -> None:
        if is_mounted(self.mount_point):
            _mounted[self.mount_point.resolve()] = self.image
            return
        if self.mount_point.resolve() not in _mounted:
            check_room(self.image, self.image.stat().st_size)
        self.mount_point.mkdir(parents=True, exist_ok=True)
        try:
            _loop.mount_image(str(self.image), str(self.mount_point), "ext4",
                              _loop.MS_NOSUID | _loop.MS_NODEV, "noinit_itable", fresh=fresh)
        except _loop.LoopError as exc:
            raise VolumeError(str(exc)) from None
        _mounted[self.mount_point.resolve()] = self.image
        os.chmod(self.mount_point, 0o711)

    def unmount(self) -> None:
        if is_mounted(self.mount_point):
            unmount(self.mount_point)
        _mounted.pop(self.mount_point.resolve(), None)

    def destroy(self) -> None:
        """Unmount and delete the image: every byte in it is gone."""
        self.unmount()
        self.image.unlink(missing_ok=True)
        try:
            self.mount_point.rmdir()
        except OSError:
            pass
