"""A tenant's uploaded files: the Files API outside any container.

Gateways upload a file once and attach it to containers by id; the bytes live
in the file store, the record in the metadata store, both scoped by tenant.
"""

from __future__ import annotations

import asyncio
import io
import secrets
import time
from typing import BinaryIO

from shoal.sandbox import FileMissing, guess_mime_type
from shoal.storage import FileStore, MetadataStore, UploadRecord

from .container_files import DeletedPlaces
from .containers import TenantQuotaExceeded


class _Reservation:
    """An upload's bytes and file counted against its tenant's quota while they
    are written; released once, however the upload ends."""

    def __init__(self, pending: list[int], size: int) -> None:
        self._pending, self._size = pending, size
        pending[0] += size
        pending[1] += 1
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pending[0] -= self._size
            self._pending[1] -= 1


class Uploads:
    def __init__(self, metadata: MetadataStore, files: FileStore, max_bytes: int,
                 max_files: int) -> None:
        self._metadata = metadata
        self._files = files
        self._max_bytes = max_bytes
        self._max_files = max_files
        # Per tenant, the uploads being written: [bytes, files]. They count as
        # stored, so of concurrent uploads that do not all fit the rest are refused
        # before their bytes are written, not after. Counting and committing hold
        # the tenant's lock (writing does not), so stored plus pending is exact
        # while the lock is free. Tenants are those the tokens name: both stay small.
        self._pending: dict[str, list[int]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._deleted = DeletedPlaces()

    def _lock(self, tenant: str) -> asyncio.Lock:
        return self._locks.setdefault(tenant, asyncio.Lock())

    def _check(self, count: int, used: int, size: int) -> None:
        if count >= self._max_files:
            raise TenantQuotaExceeded(f"this tenant holds {count} uploaded files, its quota of "
                                      f"{self._max_files}; delete some before uploading more")
        if used >= self._max_bytes:
            raise TenantQuotaExceeded(f"this tenant's uploads hold {used} bytes, its quota of "
                                      f"{self._max_bytes}; delete some before uploading more")
        if used + size > self._max_bytes:
            raise TenantQuotaExceeded(f"this upload would take this tenant's uploads past its "
                                      f"quota of {self._max_bytes} bytes")

    async def _reserve(self, tenant: str, size: int) -> _Reservation:
        async with self._lock(tenant):
            count, used = await self._metadata.upload_usage(tenant)
            pending = self._pending.setdefault(tenant, [0, 0])
            self._check(count + pending[1], used + pending[0], size)
            return _Reservation(pending, size)

    async def create(self, tenant: str, filename: str, source: BinaryIO,
                     purpose: str | None = None) -> UploadRecord:
        start = source.tell()
        size = source.seek(0, io.SEEK_END) - start
        source.seek(start)
        reservation = await self._reserve(tenant, size)
        upload_id = "file-" + secrets.token_hex(12)
        stored = False
        try:
            written = await asyncio.to_thread(self._files.write_upload, tenant, upload_id, source)
            record = UploadRecord(tenant=tenant, id=upload_id, filename=filename, size=written,
                                  created_at=time.time(), purpose=purpose,
                                  mime_type=guess_mime_type(filename))
            async with self._lock(tenant):
                # The store has the last word: front ends sharing a database do not
                # see each other's pending uploads.
                stored = await self._metadata.add_upload(record, self._max_bytes,
                                                         self._max_files)
                reservation.release()
        finally:
            reservation.release()
            if not stored:
                await asyncio.to_thread(self._files.delete_upload, tenant, upload_id)
        if not stored:
            raise TenantQuotaExceeded(f"this upload would take this tenant's uploads past its "
                                      f"quota of {self._max_bytes} bytes or "
                                      f"{self._max_files} files")
        return record

    async def get(self, tenant: str, upload_id: str) -> UploadRecord:
        record = await self._metadata.get_upload(tenant, upload_id)
        if record is None:
            raise FileMissing(f"no file {upload_id!r}")
        return record

    async def list(self, tenant: str) -> list[UploadRecord]:
        return await self._metadata.list_uploads(tenant)

    async def open(self, tenant: str, upload_id: str) -> tuple[UploadRecord, BinaryIO, int]:
        record = await self.get(tenant, upload_id)
        handle, size = await asyncio.to_thread(self._files.open_upload, tenant, upload_id)
        return record, handle, size

    async def delete(self, tenant: str, upload_id: str) -> UploadRecord:
        record = await self.get(tenant, upload_id)
        await asyncio.to_thread(self._files.delete_upload, tenant, upload_id)
        await self._metadata.delete_upload(tenant, upload_id)
        self._deleted.remember((tenant, upload_id), (record.created_at, record.id))
        return record

    def deleted_place(self, tenant: str, upload_id: str) -> tuple | None:
        """Where a deleted upload stood in the tenant's listing (its creation time
        and id, as listings sort), if it is remembered."""
        return self._deleted.place((tenant, upload_id))
