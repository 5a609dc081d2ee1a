"""A tenant's uploaded files: the Files API outside any container.

Gateways upload a file once and attach it to containers by id; the bytes live
in the file store, the record in the metadata store, both scoped by tenant.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import BinaryIO

from shoal.sandbox import FileMissing, guess_mime_type
from shoal.storage import FileStore, MetadataStore, UploadRecord

from .containers import TenantQuotaExceeded


class Uploads:
    def __init__(self, metadata: MetadataStore, files: FileStore, max_bytes: int) -> None:
        self._metadata = metadata
        self._files = files
        self._max_bytes = max_bytes

    async def create(self, tenant: str, filename: str, source: BinaryIO,
                     purpose: str | None = None) -> UploadRecord:
        stored = sum(record.size for record in await self._metadata.list_uploads(tenant))
        if stored >= self._max_bytes:
            raise TenantQuotaExceeded(f"this tenant's uploads hold {stored} bytes, its quota of "
                                      f"{self._max_bytes}; delete some before uploading more")
        upload_id = "file-" + secrets.token_hex(12)
        size = await asyncio.to_thread(self._files.write_upload, tenant, upload_id, source)
        if stored + size > self._max_bytes:
            await asyncio.to_thread(self._files.delete_upload, tenant, upload_id)
            raise TenantQuotaExceeded(f"this upload would take this tenant's uploads past its "
                                      f"quota of {self._max_bytes} bytes")
        record = UploadRecord(tenant=tenant, id=upload_id, filename=filename, size=size,
                              created_at=time.time(), purpose=purpose,
                              mime_type=guess_mime_type(filename))
        await self._metadata.put_upload(record)
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
        return record
