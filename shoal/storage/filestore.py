"""The file store: where containers' files and tenants' uploads live.

Callers name files by tenant, container and sandbox path (or upload id) and
get streams back; where the bytes sit is this module's secret. The embedded
store keeps each container on a quota-bounded volume in the data directory and
uploads as plain files beside them; an S3-compatible store would implement the
same interface by materialising a container's files for the sandbox and
syncing them back.
"""

from __future__ import annotations

import abc
import hashlib
import os
import threading
import weakref
from pathlib import Path
from typing import BinaryIO

from shoal.sandbox import FileMissing, FileTooLarge, SandboxFiles
from shoal.sandbox.mounts import SandboxHome
from shoal.sandbox.volumes import Volume, mounts_under, unmount

_CHUNK = 1 << 20


class StoreUnavailable(RuntimeError):
    """The store behind the files or the metadata cannot be used now (an object
    store that is down, refusing, or answered with something else than it was
    sent; a database that is down, restarting or out of connections)."""


class VolumeMissing(LookupError):
    """The container has no files here: never made, or destroyed with it. Only the
    sessions layer, which knows whether the container still exists, may make them
    (:meth:`FileStore.create`)."""


class FileStore(abc.ABC):
    # Whether containers' files are kept beyond this host (checkpoint() does something).
    snapshots = False

    # -- containers ---------------------------------------------------------------
    @abc.abstractmethod
    def create(self, tenant: str, container_id: str) -> SandboxHome:
        """Make the container's files, empty (its files as they are, if it has some
        already). Never on the store's own initiative: a container deleted while a
        request about it was under way would get its files back."""

    @abc.abstractmethod
    def home(self, tenant: str, container_id: str) -> SandboxHome:
        """The container's files, ready to be attached to a sandbox; VolumeMissing
        if it has none."""

    @abc.abstractmethod
    def files(self, tenant: str, container_id: str, uid: int) -> SandboxFiles:
        """Path-safe access to the container's files (VolumeMissing if it has none);
        new files belong to ``uid``."""

    def attach(self, tenant: str, container_id: str) -> tuple[SandboxHome, bool]:
        """The container's files, up to date, for a sandbox about to start on them
        (VolumeMissing if it has none); and whether a sandbox elsewhere worked on
        them since this host last did (its interpreter's state is then gone: the
        next call says so)."""
        return self.home(tenant, container_id), False

    @abc.abstractmethod
    def detach(self, tenant: str, container_id: str) -> None:
        """No sandbox uses the container's files any more."""

    def drop_local(self, tenant: str, container_id: str) -> None:
        """Forget this host's copy of the container's files (it is not the current
        container's); a copy kept elsewhere stays."""
        self.destroy(tenant, container_id)

    def checkpoint(self, tenant: str, container_id: str, sandboxed: bool = False) -> None:
        """Make the container's files as they are now durable beyond this host
        (cluster mode: a snapshot in the object store); a no-op where the local
        disk is all there is. ``sandboxed``: a sandbox works on them."""

    def unsaved(self) -> list[tuple[str, str]]:
        """Containers whose last checkpoint failed, to be tried again."""
        return []

    def local_copies(self) -> list[tuple[str, str]]:
        """Cluster mode: the containers this host keeps a copy of that no sandbox
        here works on, as (tenant, container id); empty where the local disk is all
        there is."""
        return []

    def drop_idle_copy(self, tenant: str, container_id: str) -> bool:
        """Drop this host's copy unless a sandbox here started on it meanwhile;
        whether it was dropped. Only where a copy is kept elsewhere too."""
        return False

    @abc.abstractmethod
    def destroy(self, tenant: str, container_id: str) -> None:
        """Delete every file of the container."""

    # -- uploads -------------------------------------------------------------------
    @abc.abstractmethod
    def write_upload(self, tenant: str, upload_id: str, source: BinaryIO) -> int: ...

    @abc.abstractmethod
    def open_upload(self, tenant: str, upload_id: str) -> tuple[BinaryIO, int]: ...

    @abc.abstractmethod
    def delete_upload(self, tenant: str, upload_id: str) -> None: ...

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """How many containers have files, and the bytes of disk those really use."""

    def close(self) -> None:
        """Release what the store holds open (mounts); files stay."""


def _subdirectories(path: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(path)
                if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty, or still mounted: kept


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _key(text: str, length: int) -> str:
    # Ids are client-chosen: never let one become a path component as it is.
    return hashlib.sha256(text.encode()).hexdigest()[:length]


class LocalFileStore(FileStore):
    """Container volumes as image files in the data directory, mounted under the
    run directory (which sandbox uids can traverse, whatever the data directory's
    parents allow); tenant uploads as plain files, private to the server."""

    def __init__(self, data_dir: Path, run_dir: Path, quota_bytes: int, max_file_bytes: int) -> None:
        self._images = data_dir / "containers"
        # Mount points are keyed by the data directory too: two servers with
        # their own data dirs never meet in a shared run directory.
        self._mounts = run_dir / "volumes" / _key(str(data_dir.resolve()), 16)
        self._uploads = data_dir / "uploads"
        self._quota_bytes = quota_bytes
        self._max_file_bytes = max_file_bytes
        # One lock per volume: making it (image, mount, its directories) is one
        # step to anyone opening it, who would otherwise find the image made and
        # mounted but its directories not yet there.
        # Weak: a lock lasts while someone holds it (one per container ever
        # touched was kept for the server's life).
        self._locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._locks_lock = threading.Lock()
        for directory in (self._images, self._uploads):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in (run_dir, self._mounts.parent, self._mounts):
            directory.mkdir(mode=0o711, parents=True, exist_ok=True)
            os.chmod(directory, 0o711)  # sandbox uids traverse to their own volume only

    def volume(self, tenant: str, container_id: str) -> Volume:
        tenant_key, name = _key(tenant, 16), _key(container_id, 24)
        # A stable mount point: a volume left mounted by a killed server is
        # found and reused, never mounted a second time.
        return Volume(self._images / tenant_key / f"{name}.img", self._mounts / tenant_key / name)

    def _lock(self, volume: Volume) -> threading.Lock:
        with self._locks_lock:
            lock = self._locks.get(volume.image)
            if lock is None:
                lock = self._locks[volume.image] = threading.Lock()
            return lock

    def create(self, tenant: str, container_id: str) -> SandboxHome:
        volume = self.volume(tenant, container_id)
        # Two requests making one container's volume at once would both write its
        # image, and the second would replace the one the first mounted.
        with self._lock(volume):
            if volume.exists:
                return self._open(volume, container_id)
            volume.mount_point.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
            volume.create(self._quota_bytes, journal=True)
            home = SandboxHome(volume.mount_point)
            home.create(uid=0)  # the next sandbox adopts it
            return home

    def home(self, tenant: str, container_id: str) -> SandboxHome:
        volume = self.volume(tenant, container_id)
        with self._lock(volume):
            return self._open(volume, container_id)

    def _open(self, volume: Volume, container_id: str) -> SandboxHome:
        if not volume.exists:
            raise VolumeMissing(f"container {container_id!r} has no volume")
        volume.mount_point.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
        volume.mount()
        return SandboxHome(volume.mount_point)

    def files(self, tenant: str, container_id: str, uid: int) -> SandboxFiles:
        return SandboxFiles(self.home(tenant, container_id), uid, self._max_file_bytes,
                            durable=True)

    def detach(self, tenant: str, container_id: str) -> None:
        self.volume(tenant, container_id).unmount()

    def beside_images(self, suffix: str) -> list[Path]:
        """The files beside the volumes' images named ``*<suffix>``."""
        return sorted(self._images.glob(f"*/*{suffix}"))

    def destroy(self, tenant: str, container_id: str) -> None:
        self.volume(tenant, container_id).destroy()

    def usage(self) -> tuple[int, int]:
        count = used = 0
        try:
            tenants = list(os.scandir(self._images))
        except OSError:
            return 0, 0
        for tenant in tenants:
            try:
                with os.scandir(tenant.path) as images:
                    for image in images:
                        if image.name.endswith(".img"):
                            count += 1
                            used += image.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
        return count, used

    def close(self) -> None:
        for mount_point in mounts_under(self._mounts):
            unmount(mount_point)
        # The mount points go too, and the directory they were in: each was left
        # behind, and each data directory has its own (a test makes one a
        # server). Only the two levels this store makes: a mount point still
        # mounted (its unmount failed) refuses rmdir, and nothing in it is read.
        for tenant in _subdirectories(self._mounts):
            for mount_point in _subdirectories(tenant):
                _remove_if_empty(mount_point)
            _remove_if_empty(tenant)
        _remove_if_empty(self._mounts)

    # -- uploads -------------------------------------------------------------------
    def _upload_path(self, tenant: str, upload_id: str) -> Path:
        return self._uploads / _key(tenant, 16) / _key(upload_id, 32)

    def write_upload(self, tenant: str, upload_id: str, source: BinaryIO) -> int:
        """Write an upload whole or not at all, on the disk before it returns.

        The bytes go to a file without a name (``O_TMPFILE``), named once whole
        and synced: a server killed mid-upload leaves nothing behind, and an
        upload the client was told it has survives the host's crash. Ids are
        new, so the name is made, never replaced."""
        target = self._upload_path(tenant, upload_id)
        if not target.parent.is_dir():
            target.parent.mkdir(mode=0o700, exist_ok=True)
            _fsync_directory(target.parent.parent)
        written = 0
        directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(".", os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=directory)
            with os.fdopen(fd, "wb") as handle:
                while chunk := source.read(_CHUNK):
                    written += len(chunk)
                    if written > self._max_file_bytes:
                        raise FileTooLarge(f"file is larger than {self._max_file_bytes} bytes")
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
                # linkat(AT_SYMLINK_FOLLOW): CPython uses it only given a dir_fd
                # (plain link() would link the /proc symlink itself: EXDEV).
                os.link(f"/proc/self/fd/{handle.fileno()}", target.name, dst_dir_fd=directory)
            os.fsync(directory)
        finally:
            os.close(directory)
        return written

    def open_upload(self, tenant: str, upload_id: str) -> tuple[BinaryIO, int]:
        path = self._upload_path(tenant, upload_id)
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            raise FileMissing(f"no such file: {upload_id}") from None
        return handle, os.fstat(handle.fileno()).st_size

    def delete_upload(self, tenant: str, upload_id: str) -> None:
        self._upload_path(tenant, upload_id).unlink(missing_ok=True)
