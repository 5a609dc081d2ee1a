"""The files of a container as the Files and Containers APIs see them.

The container's filesystem is the truth about which files exist: code may have
written, replaced or removed any of them since the last look. The metadata
store remembers what the filesystem cannot: when each file first appeared, who
put it there, its etag. Every listing reconciles the two, so the order is
stable (by creation time) and nothing the code did is missed.

Upload keys are relative: ``data/q3.csv`` lands in ``/mnt/user-data/uploads/``,
``outputs/chart.png`` in ``/mnt/user-data/outputs/``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import BinaryIO

from shoal.sandbox import FileAccessError, FileMissing, ProducedFile, guess_mime_type
from shoal.sandbox.files import MAX_DEPTH, MAX_PATH_BYTES, FileEntry, SandboxPath, parse_path
from shoal.sandbox.mounts import EXTERNAL, OUTPUTS, UPLOADS, WORKSPACE
from shoal.sandbox.result import decode_file_id, encode_file_id
from shoal.storage import ContainerRecord, FileRecord, MetadataStore, UploadRecord

log = logging.getLogger("shoal.containers")
# A run sees at most this many of its container's files, each at most the file
# cap; keys nested deeper than this are not laid out (they stay in the container).
EXTERNAL_FILES_PER_RUN = 50
_EXTERNAL_DEPTH = 16
# Uploads remembered as copied into containers (past it, the oldest is copied again).
_ATTACHED_KEPT = 4096

from .containers import ContainerManager


class InvalidKey(FileAccessError):
    status = 400


class DeletedPlaces:
    """Where the last ``size`` items each tenant deleted stood in their listing's
    order: a client that deletes each item of a page names a deleted one as the
    cursor of the next (the ``openai`` SDK's pagination does), which was a 400.
    Kept per tenant (the first element of each key), so one tenant's deletions
    never push out another's; tenants are those the tokens name."""

    def __init__(self, size: int = 10_000) -> None:
        self._places: dict[str, OrderedDict] = {}
        self._size = size

    def remember(self, key: tuple, place: tuple) -> None:
        places = self._places.setdefault(key[0], OrderedDict())
        places[key] = place
        places.move_to_end(key)
        while len(places) > self._size:
            places.popitem(last=False)

    def place(self, key: tuple) -> tuple | None:
        places = self._places.get(key[0])
        return places.get(key) if places is not None else None


@dataclass(frozen=True)
class ContainerFile:
    record: FileRecord

    @property
    def id(self) -> str:
        return encode_file_id(self.record.path)

    @property
    def path(self) -> str:
        return self.record.path

    @property
    def filename(self) -> str:
        return self.record.path.rsplit("/", 1)[-1]

    @property
    def key(self) -> str:
        if self.record.path.startswith(UPLOADS + "/"):
            return self.record.path[len(UPLOADS) + 1:]
        if self.record.path.startswith(OUTPUTS + "/"):
            return "outputs/" + self.record.path[len(OUTPUTS) + 1:]
        return self.record.path

    @property
    def downloadable(self) -> bool:
        return self.record.path.startswith(OUTPUTS + "/")

    @property
    def mime_type(self) -> str:
        return guess_mime_type(self.filename)


def path_for_key(key: str) -> SandboxPath:
    """The sandbox path an upload key names, or InvalidKey."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("a file key is required")
    if key.startswith("/") or "\\" in key:
        raise InvalidKey("a file key must be a relative path with '/' separators")
    if key.endswith("/"):
        raise InvalidKey("a file key must not end with '/'")
    if "\x00" in key:
        raise InvalidKey("a file key must not contain NUL bytes")
    if len(key.encode("utf-8", "surrogatepass")) > 4096:
        raise InvalidKey("a file key must be at most 4096 bytes")
    parts = key.split("/")
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in parts):
        raise InvalidKey("each segment of a file key must be at most 255 bytes")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidKey("a file key must not contain '..', '.' or empty segments")
    if parts[0] == "outputs":
        if len(parts) == 1:
            raise InvalidKey("a file key must name a file inside outputs/")
        path = SandboxPath(OUTPUTS, tuple(parts[1:]))
    else:
        path = SandboxPath(UPLOADS, tuple(parts))
    # A file the API writes must be one it can list and name again: a listing
    # walks MAX_DEPTH levels, and an id decodes to a path of MAX_PATH_BYTES.
    if len(path.parts) > MAX_DEPTH:
        raise InvalidKey(f"a file key must be at most {MAX_DEPTH} levels deep")
    if len(path.sandbox_path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidKey(f"a file's path ({path.mount}/ and its key) must be at most "
                         f"{MAX_PATH_BYTES} bytes")
    return path


class _HashingReader:
    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self.digest = hashlib.md5(usedforsecurity=False)

    def read(self, size: int = -1) -> bytes:
        chunk = self._source.read(size)
        self.digest.update(chunk)
        return chunk


class ContainerFiles:
    def __init__(self, containers: ContainerManager, metadata: MetadataStore) -> None:
        self._containers = containers
        self._metadata = metadata
        # One write of a path at a time, file and row together: two at once
        # could leave one's bytes on disk under the other's etag.
        self._writing: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._deleted = DeletedPlaces()
        # Uploads copied in, by (tenant, container, upload): the copy's etag and
        # mtime. A client's history names its container_upload blocks again on
        # every turn (and a follow-up its file_ids); unchanged, a copy stays.
        self._attached: OrderedDict[tuple[str, str, str], tuple[str | None, int]] = OrderedDict()

    def _lock(self, record: ContainerRecord, sandbox_path: str) -> asyncio.Lock:
        key = (record.tenant, record.id, sandbox_path)
        writing = self._writing.get(key)
        if writing is None:
            writing = self._writing[key] = asyncio.Lock()
        return writing

    @contextlib.asynccontextmanager
    async def _holding(self, record: ContainerRecord, sandbox_paths):
        """The write locks of these paths, taken in one order (so two holders of
        several never wait for each other)."""
        async with contextlib.AsyncExitStack() as held:
            for sandbox_path in sorted(set(sandbox_paths)):
                await held.enter_async_context(self._lock(record, sandbox_path))
            yield

    def deleted_place(self, record: ContainerRecord, file_id: str) -> tuple | None:
        """Where a file deleted through the API stood in a listing (its creation
        time and path, as listings sort), if it is remembered."""
        path = decode_file_id(file_id)
        return self._deleted.place((record.tenant, record.id, path)) if path else None

    def _forget(self, record: ContainerRecord, items: list[ContainerFile]) -> None:
        for item in items:
            self._deleted.remember((record.tenant, record.id, item.path),
                                   (item.record.created_at, item.path))

    # Every method works inside ContainerManager.using: a container deleted since
    # the caller looked it up is a 404 (UnknownContainer), never files or rows
    # written for it after its deletion.
    async def list(self, record: ContainerRecord) -> list[ContainerFile]:
        async with self._containers.using(record):
            files = await self._containers.files_of(record)

            def scan() -> list[FileEntry]:
                return [*files.list(SandboxPath(UPLOADS, ())),
                        *files.list(SandboxPath(OUTPUTS, ()))]

            entries = await asyncio.to_thread(scan)
            known = {row.path: row
                     for row in await self._metadata.list_files(record.tenant, record.id)}
            current, unsettled = [], []
            for entry in entries:
                row = known.pop(entry.path.sandbox_path, None)
                if _in_step(row, entry):
                    current.append(row)
                else:
                    unsettled.append(entry.path.sandbox_path)
            # A file new, rewritten or gone since its row was written (or a row
            # the scan missed) is looked at again with no write of its path under
            # way: an upload that landed between the scan and the reading of the
            # rows is then taken as it is, file and row, where its row used to be
            # deleted or overwritten with what the scan saw (its etag lost).
            unsettled += list(known)
            if unsettled:
                current += await self._settled(record, files, unsettled)
        current.sort(key=lambda row: (row.created_at, row.path))
        return [ContainerFile(row) for row in current]

    async def _settled(self, record: ContainerRecord, files,
                       sandbox_paths: list[str]) -> list[FileRecord]:
        """The rows of these files as they are now, each written anew where it
        does not match its file; the rows of files that are gone are deleted."""

        def look() -> dict[str, FileEntry]:
            found = {}
            for sandbox_path in sandbox_paths:
                try:
                    found[sandbox_path] = files.stat(parse_path(sandbox_path, allow_file_id=False))
                except FileAccessError:
                    continue
            return found

        async with self._holding(record, sandbox_paths):
            found = await asyncio.to_thread(look)
            if len(sandbox_paths) == 1:  # one file looked up: its row, not the container's
                row = await self._metadata.get_file(record.tenant, record.id, sandbox_paths[0])
                rows = {row.path: row} if row is not None else {}
            else:
                rows = {row.path: row
                        for row in await self._metadata.list_files(record.tenant, record.id)}
            settled = [await self._reconciled(record, entry, rows.get(sandbox_path))
                       for sandbox_path, entry in found.items()]
            gone = [sandbox_path for sandbox_path in sandbox_paths
                    if sandbox_path not in found and sandbox_path in rows]
            if gone:
                await self._metadata.delete_files(record.tenant, record.id, gone)
        return settled

    async def _reconciled(self, record: ContainerRecord, entry: FileEntry,
                          row: FileRecord | None) -> FileRecord:
        """The metadata row of a file as found on disk, recorded anew if the file
        is new (first seen now) or was written since (its etag is then unknown).
        Called holding the path's write lock, with the file looked at under it."""
        if row is not None and row.size == entry.size:
            if row.modified_ns == entry.modified_ns:
                return row
            if not row.modified_ns:  # a row from before the times were kept: from now on
                row = replace(row, modified_ns=entry.modified_ns)
                await self._metadata.put_file(row)
                return row
        row = FileRecord(
            tenant=record.tenant, container_id=record.id, path=entry.path.sandbox_path,
            created_at=row.created_at if row else entry.modified_at, size=entry.size,
            source=row.source if row else ("assistant" if entry.path.mount == OUTPUTS else "user"),
            modified_ns=entry.modified_ns)
        await self._metadata.put_file(row)
        return row

    async def get(self, record: ContainerRecord, file_id: str) -> ContainerFile:
        """One file by id: looked up directly, without listing the container."""
        path = _path_of_id(file_id)
        async with self._containers.using(record):
            files = await self._containers.files_of(record)
            try:
                entry = await asyncio.to_thread(files.stat, path)
            except FileAccessError:
                raise _missing(file_id) from None  # only regular files have ids, as listed
            if path.mount == WORKSPACE:
                # Workspace files are not listed, but addressable by id all the same.
                return ContainerFile(FileRecord(
                    tenant=record.tenant, container_id=record.id, path=path.sandbox_path,
                    created_at=entry.modified_at, size=entry.size, source="assistant"))
            row = await self._metadata.get_file(record.tenant, record.id, path.sandbox_path)
            if _in_step(row, entry):
                return ContainerFile(row)
            settled = await self._settled(record, files, [path.sandbox_path])
            if not settled:
                raise _missing(file_id)
            return ContainerFile(settled[0])

    async def put(self, record: ContainerRecord, path: SandboxPath, source: BinaryIO,
                  source_kind: str = "user", checkpoint: bool = True) -> ContainerFile:
        """Write one file into the container; with ``checkpoint``, durable beyond this
        host before it returns (a caller writing several checkpoints once, after
        the last)."""
        async with self._containers.using(record), self._lock(record, path.sandbox_path):
            files = await self._containers.files_of(record)
            reader = _HashingReader(source)
            written = await asyncio.to_thread(files.write, path, reader)
            previous = await self._metadata.get_file(record.tenant, record.id, path.sandbox_path)
            row = FileRecord(tenant=record.tenant, container_id=record.id, path=path.sandbox_path,
                             created_at=previous.created_at if previous else time.time(),
                             size=written.size, source=source_kind,
                             etag=reader.digest.hexdigest(), modified_ns=written.modified_ns)
            await self._metadata.put_file(row)
            if checkpoint:
                await self._containers.checkpoint(record)  # in the object store before the answer
            await self._containers.touch(record)
        return ContainerFile(row)

    async def checkpoint(self, record: ContainerRecord) -> None:
        """What was written to the container without a checkpoint, made durable."""
        await self._containers.checkpoint(record)

    async def open(self, record: ContainerRecord, file_id: str) -> tuple[ContainerFile, BinaryIO, int]:
        async with self._containers.using(record):
            item = await self.get(record, file_id)
            files = await self._containers.files_of(record)
            # The open handle reads on after a deletion: the bytes as they were.
            handle, size = await asyncio.to_thread(files.open_for_reading, parse_path(item.path))
        return item, handle, size

    async def delete(self, record: ContainerRecord, file_id: str) -> ContainerFile:
        async with self._containers.using(record):
            item = await self.get(record, file_id)
            files = await self._containers.files_of(record)
            async with self._lock(record, item.path):  # file and row together, as put
                await asyncio.to_thread(files.delete, parse_path(item.path))
                await self._metadata.delete_files(record.tenant, record.id, [item.path])
            self._forget(record, [item])
            await self._containers.checkpoint(record)
        return item

    async def attach_upload(self, record: ContainerRecord, upload: UploadRecord,
                            handle: BinaryIO, checkpoint: bool = True) -> ContainerFile:
        """A tenant's uploaded file, copied into the container's uploads, unless the
        copy made before is there unchanged: a conversation's every turn names
        its uploads again, and each was copied again (and, with an object store,
        the container snapshotted again), a 100 MiB file 100 MiB a turn."""
        path = SandboxPath(UPLOADS, (upload.filename,))
        key = (record.tenant, record.id, upload.id)
        with handle:
            kept = await self._kept_copy(record, path, self._attached.get(key))
            if kept is not None:
                self._attached.move_to_end(key)
                return kept
            copied = await self.put(record, path, handle, checkpoint=checkpoint)
        self._attached[key] = (copied.record.etag, copied.record.modified_ns)
        while len(self._attached) > _ATTACHED_KEPT:
            self._attached.popitem(last=False)
        return copied

    async def _kept_copy(self, record: ContainerRecord, path: SandboxPath,
                         copied: tuple[str | None, int] | None) -> ContainerFile | None:
        if copied is None:
            return None
        row = await self._metadata.get_file(record.tenant, record.id, path.sandbox_path)
        if row is None or (row.etag, row.modified_ns) != copied:
            return None  # replaced (another upload of that name), or deleted
        async with self._containers.using(record):
            files = await self._containers.files_of(record)
            try:
                entry = await asyncio.to_thread(files.stat, path)
            except FileAccessError:
                return None
        return ContainerFile(row) if (entry.size, entry.modified_ns) == (row.size, row.modified_ns) else None

    async def lay_out_external(self, record: ContainerRecord) -> int:
        """Put the container's files where a run reads them (``./external-files``):
        hard links in a read-only directory, at most 50, each within the file cap.
        What is left out is logged; returns how many were laid out."""
        async with self._containers.using(record):
            items = await self.list(record)
            files = await self._containers.files_of(record)

            def lay_out() -> int:
                files.clear(EXTERNAL)
                laid = 0
                left_out: list[tuple[str, str]] = []
                for item in items:
                    source = parse_path(item.path)
                    key = item.key.split("/")
                    if laid >= EXTERNAL_FILES_PER_RUN or len(key) > _EXTERNAL_DEPTH:
                        left_out.append((item.key, f"at most {EXTERNAL_FILES_PER_RUN} files "
                                                   f"per run, {_EXTERNAL_DEPTH} levels deep"))
                        continue
                    try:
                        files.link(source, SandboxPath(EXTERNAL, tuple(key)))
                        laid += 1
                    except FileAccessError as exc:
                        left_out.append((item.key, str(exc)))
                log_left_out(f"container {record.id}", "not laid out in external-files",
                             left_out)
                return laid

            return await asyncio.to_thread(lay_out)

    async def keep_produced(self, record: ContainerRecord, produced: list[ProducedFile],
                            limit: int) -> list[ContainerFile]:
        """Make the files a run produced the container's: new files at the top of the
        workspace are copied into outputs, files in outputs already are; at most
        ``limit``, each within the file cap. What is dropped is logged."""
        kept: list[ContainerFile] = []
        dropped: list[tuple[str, str]] = []
        copied = False
        # Where each file lands in outputs. The run's newest file for a place
        # wins (``produced`` is newest first): ./x.txt copied over the
        # outputs/x.txt the same run wrote after it lost that file, and the run
        # listed one file twice.
        taken: set[tuple[str, ...]] = set()
        async with self._containers.using(record):
            files = await self._containers.files_of(record)
            for item in produced:
                path = parse_path(item.path)
                if path.mount in (WORKSPACE, OUTPUTS) and path.parts in taken:
                    dropped.append((item.path, "a newer file of the run has its place in "
                                               "outputs"))
                    continue
                if len(kept) >= limit:
                    dropped.append((item.path, f"at most {limit} per run"))
                    continue
                try:
                    if path.mount == WORKSPACE and len(path.parts) == 1:
                        handle, _ = await asyncio.to_thread(files.open_for_reading, path)
                        with handle:
                            kept.append(await self.put(record, SandboxPath(OUTPUTS, path.parts),
                                                       handle, source_kind="assistant",
                                                       checkpoint=False))
                        copied = True
                    elif path.mount == OUTPUTS:
                        kept.append(await self.get(record, encode_file_id(path.sandbox_path)))
                    else:
                        continue
                    taken.add(path.parts)
                except FileAccessError as exc:
                    dropped.append((item.path, str(exc)))
            if copied:  # one snapshot for the run's files, not one each
                await self._containers.checkpoint(record)
        log_left_out(f"container {record.id}", "produced but not kept", dropped)
        return kept

    async def produced(self, record: ContainerRecord, produced: list[ProducedFile]) -> list[ContainerFile]:
        """The container's records of files a call produced, where the code left them."""
        found = []
        for item in produced:
            try:
                found.append(await self.get(record, encode_file_id(item.path)))
            except FileAccessError:
                continue  # gone again before we looked
        return found

    async def delete_prefix(self, record: ContainerRecord, prefix: str) -> int:
        async with self._containers.using(record):
            doomed = [item for item in await self.list(record) if item.key.startswith(prefix)]
            files = await self._containers.files_of(record)
            async with self._holding(record, [item.path for item in doomed]):
                for item in doomed:
                    await asyncio.to_thread(files.delete, parse_path(item.path))
                await self._metadata.delete_files(record.tenant, record.id,
                                                  [item.path for item in doomed])
            self._forget(record, doomed)
            if doomed:
                await self._containers.checkpoint(record)
        return len(doomed)


def log_left_out(owner: str, what: str, left_out: list[tuple[str, str]]) -> None:
    """One line for the files of a run left out, and why the first was: how many
    there are, and how long their names, is the tenant's doing (a container of a
    thousand files, or 50 forged names of 4 KiB each call), and a warning for each
    was the tenant's to multiply, hundreds of kilobytes a run at the default level.
    The operator has nothing to do about them: info, as for a client's error."""
    if left_out:
        path, why = left_out[0]
        log.info("%s: %d files %s; the first, %s: %s", owner, len(left_out), what,
                 path[:256], why[:256])


# A container's file named without its container: the form the Anthropic dialect
# hands out (``bash_code_execution_output``), which the tenant Files API resolves.
_SCOPED_PREFIX = "file_c"


def scoped_file_id(container_id: str, sandbox_path: str) -> str:
    return _SCOPED_PREFIX + encode_file_id(f"{container_id}\x00{sandbox_path}")


def parse_scoped_file_id(file_id: str) -> tuple[str, str] | None:
    """(container id, file id within it) for an id made by :func:`scoped_file_id`."""
    if not file_id.startswith(_SCOPED_PREFIX):
        return None
    try:
        padded = file_id[len(_SCOPED_PREFIX):]
        raw = base64.urlsafe_b64decode((padded + "=" * (-len(padded) % 4)).encode("ascii"))
        container_id, _, path = raw.decode("utf-8").partition("\x00")
    except (ValueError, UnicodeError):
        return None
    if not container_id or not path.startswith("/"):
        return None
    return container_id, encode_file_id(path)


def _in_step(row: FileRecord | None, entry: FileEntry) -> bool:
    """Whether a file's row was written for the file as it is."""
    return (row is not None and row.size == entry.size and bool(row.modified_ns)
            and row.modified_ns == entry.modified_ns)


def _path_of_id(file_id: str) -> SandboxPath:
    decoded = decode_file_id(file_id)
    if decoded is None:
        raise _missing(file_id)
    try:
        path = parse_path(decoded, allow_file_id=False)
    except FileAccessError:
        raise _missing(file_id) from None
    if not path.parts:
        raise _missing(file_id)
    return path


def _missing(file_id: str) -> FileAccessError:
    return FileMissing(f"no file {file_id!r} in this container")
