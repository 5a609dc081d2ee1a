"""Host-side access to a sandbox's files that no planted link can redirect.

The server runs as root and the files it serves were shaped by hostile code,
which may plant a symlink (``outputs/x -> /etc/shadow``), swap one in between
a check and a use, or leave a FIFO where a file is expected. So every path is
walked one component at a time with ``openat`` and ``O_NOFOLLOW`` from the
directory we mounted, and any symlink on the way is refused: no component is
ever resolved by the kernel on our behalf.

Paths are the sandbox's own: relative ones start at the workspace, absolute
ones must lie in the workspace, outputs or uploads. A file id (the unpadded
base64url of an absolute sandbox path) is accepted wherever a path is.
"""

from __future__ import annotations

import errno
import mimetypes
import os
import secrets
import stat
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from .mounts import EXTERNAL, OUTPUTS, UPLOADS, WORKSPACE, SandboxHome
from .result import decode_file_id

MAX_PATH_BYTES = 4096
# Directories the code may read but never change: what the host puts there stays root's.
_ROOT_OWNED = (UPLOADS, EXTERNAL)
MAX_LISTED = 10_000
# A walk reads at most this many directory entries and goes this deep, so that
# what one listing costs does not depend on what the code left behind.
MAX_SCANNED = 100_000
MAX_DEPTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The name a file being written has between its last byte and its rename over the
# target. Brief, but not instant: renaming over a file makes ext4 start writing the
# new one's data back first (15 ms for 48 MiB on this disk). A listing leaves it out.
_WRITING_PREFIX = ".shoal-upload-"


class FileAccessError(Exception):
    """A file operation that cannot be done; ``status`` is the HTTP answer."""

    status = 400


class PathOutside(FileAccessError):
    status = 403


class FileMissing(FileAccessError):
    status = 404


class SandboxGone(FileMissing):
    """The sandbox's directories are gone: it was released while the call ran."""


class IsDirectory(FileAccessError):
    status = 400


class NotADirectory(FileAccessError):
    """A write below a file: the path is wrong, nothing is missing."""

    status = 400


class FileTooLarge(FileAccessError):
    status = 413


class QuotaExceeded(FileAccessError):
    """The session's or container's disk quota is full."""

    status = 507


@dataclass(frozen=True)
class SandboxPath:
    """A validated path: the mount it lies in and its components below it."""

    mount: str
    parts: tuple[str, ...]

    @property
    def sandbox_path(self) -> str:
        return "/".join((self.mount, *self.parts))

    @property
    def relative(self) -> str:
        """As the protocol reports paths: relative to the workspace where it can be."""
        if self.mount == WORKSPACE:
            return "/".join(self.parts) or "."
        return self.sandbox_path


@dataclass(frozen=True)
class FileEntry:
    path: SandboxPath
    size: int
    modified_at: float
    # The same time to the nanosecond: what tells a file's metadata (its etag)
    # from one that code rewrote since, at the same size.
    modified_ns: int = 0

    @property
    def mime_type(self) -> str:
        return guess_mime_type(self.path.parts[-1] if self.path.parts else "")


def guess_mime_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


def parse_path(raw: str, allow_file_id: bool = True) -> SandboxPath:
    """Validate a client's path (or file id) without touching the filesystem."""
    if not isinstance(raw, str) or not raw:
        raise FileAccessError("path must be a non-empty string")
    if "\x00" in raw:
        raise FileAccessError("path must not contain NUL bytes")
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise FileAccessError(f"path is longer than {MAX_PATH_BYTES} bytes")
    if allow_file_id and not raw.startswith("/") and "/" not in raw and "." not in raw:
        decoded = decode_file_id(raw)
        if decoded is not None and decoded.startswith(("/home/", "/mnt/")):
            return parse_path(decoded, allow_file_id=False)
    mount = WORKSPACE
    rest = raw
    if raw.startswith("/"):
        for candidate in (WORKSPACE, OUTPUTS, UPLOADS):
            if raw == candidate or raw.startswith(candidate + "/"):
                mount, rest = candidate, raw[len(candidate):]
                break
        else:
            raise PathOutside(f"{raw} is outside the session's files")
    parts = []
    for part in rest.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise PathOutside("path must not contain '..'")
        parts.append(part)
    return SandboxPath(mount, tuple(parts))


class SandboxFiles:
    """Reads and writes one sandbox's files from the host, safely."""

    def __init__(self, home: SandboxHome, uid: int, max_file_bytes: int,
                 durable: bool = False) -> None:
        self._home = home
        self._uid = uid
        self._max_file_bytes = max_file_bytes
        # Files that outlive their sandbox (a container's) are written through to
        # the disk before a write returns: an acknowledged upload survives the
        # host's crash, not only the server's. An ephemeral session's die with it.
        self._durable = durable

    # -- walking --------------------------------------------------------------
    def _open_dir(self, mount: str, parts: tuple[str, ...], create: bool = False) -> int:
        root = self._home.host_path_of(mount)
        if root is None:
            raise PathOutside(f"{mount} is not one of the session's mounts")
        try:
            fd = os.open(root, _DIR_FLAGS)
        except FileNotFoundError:
            # The mounts are removed only when the sandbox is released, so a
            # call that began before a release (an upload still streaming in)
            # finds the session gone, as an exec caught by a release does.
            raise SandboxGone("the session was released while the call ran") from None
        try:
            for part in parts:
                try:
                    next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise FileMissing(f"no such directory: {part}") from None
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if mount not in _ROOT_OWNED:
                            os.chown(part, self._uid, self._uid, dir_fd=fd, follow_symlinks=False)
                        next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        raise _refusal(exc, part) from None
                except OSError as exc:
                    mode = _mode(part, fd) if exc.errno == errno.ENOTDIR else None
                    if mode is not None and stat.S_ISLNK(mode):
                        raise PathOutside(f"{part} is a symbolic link; links are not followed") from None
                    if create and mode is not None and not stat.S_ISDIR(mode):
                        # A write's 404 reads as a session or container gone, and a
                        # client may drop it and start anew: this is the path's fault.
                        raise NotADirectory(f"{part} is a file, not a directory") from None
                    raise _refusal(exc, part) from None
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- operations -------------------------------------------------------------
    def open_for_reading(self, path: SandboxPath) -> tuple[BinaryIO, int]:
        """An open file and its size; the file cannot change identity once opened."""
        fd, info = self._open_regular(path)
        if info.st_size > self._max_file_bytes:
            os.close(fd)
            raise FileTooLarge(f"{path.relative} is larger than {self._max_file_bytes} bytes")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size

    def _open_regular(self, path: SandboxPath) -> tuple[int, os.stat_result]:
        """A non-blocking fd on a regular file, never through a link, and its stat."""
        if not path.parts:
            raise IsDirectory(f"{path.relative} is a directory")
        directory = self._open_dir(path.mount, path.parts[:-1])
        try:
            try:
                fd = os.open(path.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, dir_fd=directory)
            except OSError as exc:
                raise _refusal(exc, path.relative) from None
        finally:
            os.close(directory)
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            os.close(fd)
            raise IsDirectory(f"{path.relative} is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise FileAccessError(f"{path.relative} is not a regular file")
        return fd, info

    def list(self, path: SandboxPath) -> list[FileEntry]:
        """Regular files under a directory, recursively, without following links."""
        directory = self._open_dir(path.mount, path.parts)
        try:
            entries = [FileEntry(SandboxPath(path.mount, parts), info.st_size, info.st_mtime,
                                 info.st_mtime_ns)
                       for parts, info in _walk(directory, path.parts)]
        finally:
            os.close(directory)
        entries.sort(key=lambda entry: entry.path.parts)
        return entries

    def stat(self, path: SandboxPath) -> FileEntry:
        """Size and time of one regular file, without following links. Whatever
        its size: code can write a file past the cap, which a listing shows, and
        its metadata and its deletion must not be refused for it (only its bytes
        are not served)."""
        fd, info = self._open_regular(path)
        os.close(fd)
        return FileEntry(path, info.st_size, info.st_mtime, info.st_mtime_ns)

    def delete(self, path: SandboxPath) -> None:
        """Remove one file (never a directory, never through a link)."""
        if not path.parts:
            raise IsDirectory("a file path is required, not a directory")
        directory = self._open_dir(path.mount, path.parts[:-1])
        try:
            info = os.stat(path.parts[-1], dir_fd=directory, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                raise IsDirectory(f"{path.relative} is a directory")
            os.unlink(path.parts[-1], dir_fd=directory)
        except FileNotFoundError:
            raise FileMissing(f"no such file: {path.relative}") from None
        finally:
            os.close(directory)

    def write(self, path: SandboxPath, source: BinaryIO) -> FileEntry:
        """Write ``source`` to ``path`` atomically; returns what was written.

        The bytes land in a file without a name (``O_TMPFILE``) in the target's
        directory, which is named only once whole and renamed over the target:
        a reader never sees half a file, and neither a failed upload nor a
        server killed in the middle of one leaves anything behind (a named
        temporary file was listed, with its partial size, and its bytes seen by
        the code, for as long as the copy took; one left by a crash stayed for
        good). Listings leave out the name it has until the rename.
        ``rename`` replaces a planted symlink rather than following it.
        """
        if not path.parts:
            raise IsDirectory("a file path is required, not a directory")
        directory = self._open_dir(path.mount, path.parts[:-1], create=True)
        temporary = f"{_WRITING_PREFIX}{secrets.token_hex(8)}"
        written = 0
        named = False
        try:
            fd = os.open(".", os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o644, dir_fd=directory)
            try:
                with os.fdopen(fd, "wb") as target:
                    while chunk := source.read(1 << 20):
                        written += len(chunk)
                        if written > self._max_file_bytes:
                            raise FileTooLarge(f"file is larger than {self._max_file_bytes} bytes")
                        target.write(chunk)
                    target.flush()  # its last write, so that the time is the file's
                    if self._durable:
                        os.fsync(target.fileno())
                    info = os.fstat(target.fileno())
                    if path.mount not in _ROOT_OWNED:  # read-only to code
                        os.fchown(target.fileno(), self._uid, self._uid)
                    os.link(f"/proc/self/fd/{target.fileno()}", temporary,
                            dst_dir_fd=directory)
                    named = True
                os.rename(temporary, path.parts[-1], src_dir_fd=directory, dst_dir_fd=directory)
                if self._durable:
                    os.fsync(directory)  # the name, as the bytes
            except BaseException:
                if named:
                    try:
                        os.unlink(temporary, dir_fd=directory)
                    except OSError:
                        pass
                raise
        except IsADirectoryError:
            raise IsDirectory(f"{path.relative} is a directory") from None
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise IsDirectory(f"{path.relative} is a directory") from None
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise QuotaExceeded("the disk quota of these files is full") from None
            raise _refusal(exc, path.relative) from None
        finally:
            os.close(directory)
        return FileEntry(path, written, info.st_mtime, info.st_mtime_ns)


    # -- the host's own directories ------------------------------------------------
    def link(self, source: SandboxPath, target: SandboxPath) -> None:
        """Hard-link a regular file to a second name (same volume); never through a link."""
        source_dir = self._open_dir(source.mount, source.parts[:-1])
        try:
            info = os.stat(source.parts[-1], dir_fd=source_dir, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                raise FileAccessError(f"{source.relative} is not a regular file")
            if info.st_size > self._max_file_bytes:
                raise FileTooLarge(f"{source.relative} is larger than {self._max_file_bytes} bytes")
            target_dir = self._open_dir(target.mount, target.parts[:-1], create=True)
            try:
                os.link(source.parts[-1], target.parts[-1], src_dir_fd=source_dir,
                        dst_dir_fd=target_dir, follow_symlinks=False)
            except OSError as exc:
                raise _refusal(exc, target.relative) from None
            finally:
                os.close(target_dir)
        except FileNotFoundError:
            raise FileMissing(f"no such file: {source.relative}") from None
        finally:
            os.close(source_dir)

    def clear(self, mount: str) -> None:
        """Empty one of the host-owned directories (only the host ever writes there)."""
        if mount not in _ROOT_OWNED:
            raise PathOutside(f"{mount} is not a host-owned directory")
        _remove_contents(self._open_dir(mount, ()))


def _remove_contents(directory_fd: int) -> None:
    """Remove everything below a directory, by fd, never following a link; closes the fd."""
    try:
        for entry in os.scandir(directory_fd):
            if entry.is_dir(follow_symlinks=False):
                _remove_contents(os.open(entry.name, _DIR_FLAGS, dir_fd=directory_fd))
                os.rmdir(entry.name, dir_fd=directory_fd)
            else:
                os.unlink(entry.name, dir_fd=directory_fd)
    finally:
        os.close(directory_fd)


def _walk(directory_fd: int, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], os.stat_result]]:
    """Regular files under a directory, depth first, never following a link.

    The tree was shaped by hostile code, so every bound is the walk's own: it
    holds one fd per level (at most ``MAX_DEPTH`` levels), reads at most
    ``MAX_SCANNED`` entries, and closes every fd it opened on every exit. Names
    that are not UTF-8 are skipped: no API could name them anyway.
    """
    found: list[tuple[tuple[str, ...], os.stat_result]] = []
    scanned = 0
    # Each level: (its fd, its path parts, an iterator over its entries).
    stack: list[tuple[int, tuple[str, ...], Iterator[os.DirEntry]]] = []

    def descend(fd: int, parts: tuple[str, ...]) -> None:
        try:
            entries = os.scandir(fd)
        except OSError:
            os.close(fd)
            return
        stack.append((fd, parts, entries))

    descend(os.dup(directory_fd), prefix)
    try:
        while stack and len(found) < MAX_LISTED and scanned < MAX_SCANNED:
            fd, parts, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                entries.close()
                os.close(fd)
                stack.pop()
                continue
            scanned += 1
            if not _utf8(entry.name) or entry.name.startswith(_WRITING_PREFIX):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append(((*parts, entry.name), info))
            elif stat.S_ISDIR(info.st_mode) and len(stack) < MAX_DEPTH:
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                descend(child, (*parts, entry.name))
    finally:
        for fd, _, entries in stack:
            entries.close()
            os.close(fd)
    return found


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mode(name: str, dir_fd: int) -> int | None:
    """What ``name`` is now (its st_mode, never through a link), or None if gone."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return None


def _refusal(exc: OSError, name: str) -> FileAccessError:
    if exc.errno == errno.ELOOP:
        return PathOutside(f"{name} is a symbolic link; links are not followed")
    if exc.errno == errno.ENOTDIR:
        return FileMissing(f"{name}: a component of the path is not a directory")
    if exc.errno == errno.ENOENT:
        return FileMissing(f"no such file: {name}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PathOutside(f"{name}: permission denied")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return QuotaExceeded("the disk quota of these files is full")
    if exc.errno == errno.ENAMETOOLONG:
        return FileAccessError(f"{name}: name too long")
    return FileAccessError(f"{name}: {exc.strerror}")
