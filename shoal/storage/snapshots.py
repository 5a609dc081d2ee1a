"""Container snapshots in the object store: how a container outlives its host.

In cluster mode a container's files live on the volume of the host whose
sandbox works on them, and in the bucket as a snapshot: a manifest (every
path with its kind, mode, size, modification time and content hash) and one
object per distinct content, named by its SHA-256. A snapshot is incremental:
a file whose size and modification time match the previous manifest keeps its
hash unread, and content the bucket holds already is not sent again. Every
object goes up with its MD5, which the store checks, and every byte coming
back is checked against its SHA-256 before it is written: a restore is exact
or it fails, never a container quietly missing a file.

The manifest is written last, so a host that dies halfway through a snapshot
leaves the previous one whole; content no manifest names any more is deleted
after the new manifest is in place. Each manifest has a version, a random id;
a host remembers which version its local copy matches (beside the volume's
image), and a copy whose version is not the bucket's is stale: another host
worked on the container since (or it was deleted and made anew), and the copy
is replaced by a restore.

What is saved is what the sandbox and the Files API can change (the
workspace, outputs, uploads and the container's skills); the rest of a home is
laid out anew for each sandbox. The walk never follows a link (a link is saved
as a link), skips what is not a file, directory or link, and a container with
more entries than :data:`MAX_ENTRIES` (or nested deeper than :data:`MAX_DEPTH`)
is not snapshotted at all (logged): a partial snapshot would restore as a
container that silently lost files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from .filestore import StoreUnavailable, _key

log = logging.getLogger("shoal.storage")

SAVED_DIRS = ("workspace", "outputs", "uploads", "skills")
MAX_ENTRIES = 50_000
MAX_DEPTH = 256
_CHUNK = 1 << 20
_SPOOL_BYTES = 8 << 20
_FORMAT = 1


class SnapshotTooLarge(RuntimeError):
    """The container holds more entries than a snapshot may name."""


@dataclass(frozen=True)
class Manifest:
    version: str
    # path -> [kind, mode, size, mtime_ns, ref, ctime_ns]: kind "f" (ref: SHA-256), "d",
    # "l" (ref: target); ctime_ns is the saving host's, only ever compared there.
    entries: dict[str, list]
    # Whether a sandbox ever worked on the files (not only the Files API): a
    # restore of such a container starts a fresh interpreter on someone's state.
    sandboxed: bool = False

    def blobs(self) -> set[str]:
        return {entry[4] for entry in self.entries.values() if entry[0] == "f"}

    def encode(self) -> bytes:
        return json.dumps({"format": _FORMAT, "version": self.version, "sandboxed": self.sandboxed,
                           "entries": self.entries}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise ValueError("not a snapshot manifest this Shoal reads")
        entries = body.get("entries")
        if not isinstance(entries, dict) or not isinstance(body.get("version"), str):
            raise ValueError("a snapshot manifest without entries or version")
        for path, entry in entries.items():
            _check_entry(path, entry)
            parent = path.rpartition("/")[0]
            # A restore writes as root: nothing goes below an entry that is not a
            # directory of this very manifest (a link included).
            if parent and entries.get(parent, [None])[0] != "d":
                raise ValueError(f"a snapshot manifest names {path!r} below a non-directory")
        return cls(body["version"], entries, bool(body.get("sandboxed")))


def _check_entry(path: str, entry: object) -> None:
    """A manifest is ours, but a restore writes as root: every path stays inside
    the saved directories, and every entry has the shape it should."""
    parts = path.split("/")
    if parts[0] not in SAVED_DIRS or any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise ValueError(f"a snapshot manifest names an impossible path {path!r}")
    if (not isinstance(entry, list) or len(entry) != 6 or entry[0] not in ("f", "d", "l")
            or not all(isinstance(n, int) for n in (*entry[1:4], entry[5]))
            or not isinstance(entry[4], str)):
        raise ValueError(f"a snapshot manifest entry for {path!r} is malformed")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def walk(root: Path):
    """Every entry of the saved directories under ``root``, as (path, entry,
    directory fd, name): links never followed, at any level. The walk holds each
    directory of the current path open and goes on by name relative to it
    (``O_NOFOLLOW``), so code that swaps a directory for a link while a snapshot
    runs (it runs beside the sandbox) sends the walk nowhere but into its own
    files. Depth first: it holds one fd per level, never one per directory still
    to visit. Entries are ``[kind, mode, size, mtime_ns, ref, ctime_ns]``; a
    file's ref is filled in by the caller."""
    top = os.open(root, _DIR_FLAGS)
    opened = [top]
    try:
        count = 0
        for name in SAVED_DIRS:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=top)
            except OSError:
                continue  # absent (or not a directory): nothing of it is saved
            opened.append(fd)
            info = os.fstat(fd)
            yield name, ["d", stat.S_IMODE(info.st_mode), 0, info.st_mtime_ns, "", 0], top, name
            stack = [(name, fd, _listing(fd))]
            while stack:
                relative, directory, items = stack[-1]
                if not items:
                    stack.pop()
                    opened.remove(directory)
                    os.close(directory)
                    continue
                item, info = items.pop()
                count += 1
                if count > MAX_ENTRIES:
                    raise SnapshotTooLarge(f"more than {MAX_ENTRIES} files and directories")
                path = f"{relative}/{item}"
                mode = stat.S_IMODE(info.st_mode)
                if stat.S_ISREG(info.st_mode):
                    yield path, ["f", mode, info.st_size, info.st_mtime_ns, "",
                                 info.st_ctime_ns], directory, item
                elif stat.S_ISDIR(info.st_mode):
                    if len(stack) >= MAX_DEPTH:
                        raise SnapshotTooLarge(f"directories nested more than {MAX_DEPTH} deep")
                    try:
                        child = os.open(item, _DIR_FLAGS, dir_fd=directory)
                    except OSError:
                        continue  # gone, or swapped for something else
                    opened.append(child)
                    yield path, ["d", mode, 0, info.st_mtime_ns, "", 0], directory, item
                    stack.append((path, child, _listing(child)))
                elif stat.S_ISLNK(info.st_mode):
                    try:
                        target = os.readlink(item, dir_fd=directory)
                    except OSError:
                        continue
                    yield path, ["l", 0o777, 0, 0, target, 0], directory, item
                # fifos, sockets, devices: nothing a container keeps
    finally:
        for fd in opened:
            os.close(fd)


def _listing(directory: int) -> list[tuple[str, os.stat_result]]:
    try:
        with os.scandir(directory) as listing:
            return [(item.name, item.stat(follow_symlinks=False)) for item in listing]
    except OSError:
        return []


def _same_content(before: list | None, entry: list) -> bool:
    """Unchanged since the last snapshot by every time the kernel keeps (the
    change time too: code can set a file's modification time, not that)."""
    return (before is not None and before[0] == "f" and before[2:4] == entry[2:4]
            and len(before) > 5 and before[5] == entry[5])


class Snapshots:
    """The bucket's side: read, write and delete one container's snapshot."""

    def __init__(self, client, bucket: str, prefix: str) -> None:
        self._client = client
        self._bucket = bucket
        self._prefix = prefix

    def _base(self, tenant: str, container_id: str) -> str:
        return f"{self._prefix}containers/{_key(tenant, 16)}/{_key(container_id, 24)}/"

    def manifest(self, tenant: str, container_id: str) -> Manifest | None:
        """The container's last snapshot, or None if it has none."""
        key = self._base(tenant, container_id) + "manifest.json"
        try:
            raw = self._client.get_object(Bucket=self._bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        try:
            return Manifest.decode(raw)
        except ValueError as exc:
            log.error("container snapshot %s is unreadable: %s", key, exc)
            raise StoreUnavailable("the container's snapshot cannot be read") from None

    def save(self, tenant: str, container_id: str, root: Path, previous: Manifest | None,
             sandboxed: bool, spool_dir: Path | None = None) -> tuple[Manifest, int]:
        """Snapshot the files under ``root`` after ``previous`` (the bucket's
        current manifest, or None): the new manifest, and the bytes sent. When
        nothing changed, ``previous`` itself and 0."""
        known = previous.entries if previous is not None else {}
        stored = previous.blobs() if previous is not None else set()
        base = self._base(tenant, container_id)
        entries: dict[str, list] = {}
        sent = 0
        for path, entry, directory, name in walk(root):
            if entry[0] == "f":
                before = known.get(path)
                if _same_content(before, entry):
                    entry[4] = before[4]
                else:
                    digest = self._put_blob(base, directory, name, entry, stored, spool_dir)
                    if digest is None:
                        continue  # gone or unreadable since the listing: not in this one
                    if digest not in stored:
                        sent += entry[2]
                        stored.add(digest)
                    entry[4] = digest
            entries[path] = entry
        sandboxed = sandboxed or (previous is not None and previous.sandboxed)
        if previous is not None and previous.entries == entries and previous.sandboxed == sandboxed:
            return previous, 0
        manifest = Manifest(secrets.token_hex(8), entries, sandboxed)
        body = manifest.encode()
        self._client.put_object(Bucket=self._bucket, Key=base + "manifest.json", Body=body,
                                ContentMD5=_md5(body))
        # Content only the replaced manifest named: gone once the new one is in
        # place. The snapshot is taken by then, whatever comes of this: a save
        # that failed here had its caller go on from the replaced manifest, whose
        # content (some of it deleted) it took for stored and named again
        # without sending it, a snapshot that no longer restores. What a failed
        # deletion leaves, no manifest names; it goes with the container.
        for digest in (previous.blobs() if previous is not None else set()) - manifest.blobs():
            try:
                self._client.delete_object(Bucket=self._bucket, Key=f"{base}blobs/{digest}")
            except (ClientError, BotoCoreError) as exc:
                log.warning("could not delete a replaced snapshot's content (it stays until the "
                            "container is deleted): %s", type(exc).__name__)
                break
        return manifest, sent

    def _put_blob(self, base: str, directory: int, name: str, entry: list, stored: set[str],
                  spool_dir: Path | None) -> str | None:
        """Hash a file (opened by name in its directory, never through a link;
        read once, through a spool) and send it unless the bucket has that
        content; its SHA-256, or None if it cannot be read now."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=directory)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as source, tempfile.SpooledTemporaryFile(
                _SPOOL_BYTES, dir=spool_dir) as spool:
            info = os.fstat(source.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None
            sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
            while chunk := source.read(_CHUNK):
                sha.update(chunk)
                md5.update(chunk)
                spool.write(chunk)
                size += len(chunk)
            after = os.fstat(source.fileno())
            # What was read is what is described. A file written while it was read
            # is recorded with no change time, so the next snapshot reads it again.
            entry[2], entry[3] = size, info.st_mtime_ns
            entry[5] = info.st_ctime_ns if after.st_ctime_ns == info.st_ctime_ns else 0
            digest = sha.hexdigest()
            if digest not in stored:
                spool.seek(0)
                self._client.put_object(Bucket=self._bucket, Key=f"{base}blobs/{digest}",
                                        Body=spool, ContentLength=size,
                                        ContentMD5=base64.b64encode(md5.digest()).decode())
        return digest

    def restore(self, tenant: str, container_id: str, root: Path, manifest: Manifest) -> None:
        """Write the snapshot's files under ``root``, a fresh and empty home: every
        file checked against its hash; owned by root until a sandbox adopts them."""
        base = self._base(tenant, container_id)
        # Parents before children; directories' own times last (writing into
        # them moves their times).
        ordered = sorted(manifest.entries.items(), key=lambda item: item[0].count("/"))
        for path, (kind, mode, _, mtime_ns, ref, _) in ordered:
            target = root / path
            if kind == "d":
                target.mkdir(mode=0o700, exist_ok=True)
            elif kind == "l":
                os.symlink(ref, target)
            else:
                self._get_blob(f"{base}blobs/{ref}", target, ref)
            if kind != "l":
                os.chmod(target, mode, follow_symlinks=False)
            if kind == "f":
                os.utime(target, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        for path, (kind, _, _, mtime_ns, _, _) in reversed(ordered):
            if kind == "d":
                os.utime(root / path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)

    def _get_blob(self, key: str, target: Path, digest: str) -> None:
        body = self._client.get_object(Bucket=self._bucket, Key=key)["Body"]
        sha = hashlib.sha256()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "wb") as handle:
            while chunk := body.read(_CHUNK):
                sha.update(chunk)
                handle.write(chunk)
        if sha.hexdigest() != digest:
            log.error("container snapshot object %s does not match its hash", key)
            raise StoreUnavailable("the container's snapshot is damaged (a file does not match "
                                   "its checksum)")

    def delete(self, tenant: str, container_id: str) -> None:
        """Every object of the container's snapshot: the manifest first, so what a
        crash halfway leaves is content that nothing names."""
        base = self._base(tenant, container_id)
        self._client.delete_object(Bucket=self._bucket, Key=base + "manifest.json")
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self._bucket, Prefix=base):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": keys})


def _md5(body: bytes) -> str:
    return base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
